{{/*
The operator's permissions, grouped by why it needs them. Namespaced rules go into one
ClusterRole (watch.allNamespaces) or into a Role in each watched namespace; the
cluster-scoped rules that kopf itself needs always go into a ClusterRole.
Every verb here is one the operator uses; the end-to-end tests run it under exactly these.
*/}}

{{- define "sluice-operator.rules.namespaced" -}}
# The API: read and watch StreamingModels; patch them for kopf's bookkeeping
# (finalizers, last-handled-configuration annotation).
- apiGroups: ["serving.sluice.dev"]
  resources: ["streamingmodels"]
  verbs: ["get", "list", "watch", "patch"]
# Status (phase, conditions, URLs) is written through the status subresource.
- apiGroups: ["serving.sluice.dev"]
  resources: ["streamingmodels/status"]
  verbs: ["get", "patch", "update"]
# Children carry ownerReferences with blockOwnerDeletion; clusters with the
# OwnerReferencesPermissionEnforcement admission plugin require this to set them.
- apiGroups: ["serving.sluice.dev"]
  resources: ["streamingmodels/finalizers"]
  verbs: ["update"]
# The model servers: server-side apply (patch; create when absent), watched so that a
# Deployment edited or deleted by hand is put back and its status mirrored.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update"]
# The Service in front of the model servers.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "update"]
# Read only: why pods are Pending (e.g. no node with free GPUs) goes into the status.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Kubernetes Events about StreamingModels (invalid spec, applied children); kopf posts
# core/v1 events and the API server may patch repeated ones.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# Optional children, deleted again when the spec turns them off.
- apiGroups: ["networking.k8s.io"]
  resources: ["ingresses"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
{{- if .Values.keda.enabled }}
# keda.enabled: KEDA ScaledObjects instead of or next to the HPA.
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
{{- end }}
{{- end -}}

{{- define "sluice-operator.rules.peering.namespaced" -}}
# kopf peering (peering.enabled): replicas agree on the active one through KopfPeering.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end -}}

{{- define "sluice-operator.rules.cluster" -}}
# kopf: notices CRDs being added, changed or removed (resource discovery at run time).
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
{{- if not .Values.watch.allNamespaces }}
# kopf: with a list of namespaces it lists and watches namespaces to follow their
# creation and deletion (cluster-wide mode does not need this).
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- if and .Values.peering.enabled .Values.watch.allNamespaces }}
# kopf peering (peering.enabled) for a cluster-wide operator: ClusterKopfPeering.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end -}}
