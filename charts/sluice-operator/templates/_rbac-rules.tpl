{{/*
The operator's permissions, grouped by why it needs them (operator/README.md lists the
calls). They go into one ClusterRole when watch.allNamespaces is true, otherwise into a
Role in each watched namespace. Nothing is cluster-scoped beyond that: the operator turns
kopf's runtime CRD and namespace scanning off, never reads Secrets, and runs --standalone
unless peering is enabled. The end-to-end tests run the operator under exactly these rules.
*/}}

{{- define "sluice-operator.rules.namespaced" -}}
# The API: kopf lists and watches StreamingModels and patches its bookkeeping annotations
# (last handled spec, handler progress) onto them.
- apiGroups: ["serving.sluice.dev"]
  resources: ["streamingmodels"]
  verbs: ["get", "list", "watch", "patch"]
# Status (phase, conditions, URLs) is written through the status subresource.
- apiGroups: ["serving.sluice.dev"]
  resources: ["streamingmodels/status"]
  verbs: ["get", "patch"]
# Children point at their StreamingModel with blockOwnerDeletion; on clusters with the
# OwnerReferencesPermissionEnforcement admission plugin (e.g. OpenShift) setting that needs
# update on the owner's finalizers.
- apiGroups: ["serving.sluice.dev"]
  resources: ["streamingmodels/finalizers"]
  verbs: ["update"]
# Always-present children, server-side applied (patch; a patch that creates an object is
# also authorized as create) and watched so hand edits and deletions are put back.
# Deletion is the garbage collector's job (owner references), so no delete.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Optional children: as above, plus delete when the spec turns them off (ingress disabled,
# autoscaling off, at most one replica so no PodDisruptionBudget, networkPolicy disabled).
- apiGroups: ["networking.k8s.io"]
  resources: ["ingresses"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Gateway API HTTPRoutes for models with spec.gateway: read, server-side applied, deleted when a
# model moves back to an Ingress. Not watched (the Gateway API CRDs may be absent), so no
# list/watch; granting a resource a cluster does not serve is harmless.
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "create", "patch", "delete"]
# Read only: model pods are watched so a pod turning Ready or Pending updates the status at
# once, and listed for why they are Pending (PodScheduled condition, e.g. no free GPUs).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# Kubernetes Events on StreamingModels (invalid spec, applied children), posted by kopf.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.keda.enabled }}
# keda.enabled: KEDA ScaledObjects for models with autoscaling.backend keda: read, server-side
# applied, deleted when a model moves back to the HPA. Not watched (KEDA's CRD may be absent),
# so no list/watch.
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- if .Values.podMonitors.enabled }}
# podMonitors.enabled: Prometheus Operator PodMonitors for models with
# observability.podMonitor.enabled: read, server-side applied, deleted when the model turns
# it off. Not watched (the CRD may be absent), so no list/watch.
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- if .Values.peering.enabled }}
{{- if .Values.watch.allNamespaces }}
# peering.enabled, cluster-wide: keep-alives in a ClusterKopfPeering (a higher-priority peer pauses us).
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- else }}
# peering.enabled, per namespace: keep-alives in a KopfPeering (a higher-priority peer pauses us).
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}
{{- end -}}

{{/*
Leader election (leaderElection.enabled): one Lease in the release namespace, in a Role
there whatever the watch mode. The operator reads it, creates it once and renews or releases
it with a PUT carrying the resourceVersion it read (no patch, list, watch or delete).
*/}}
{{- define "sluice-operator.rules.election" -}}
# Creating cannot be limited to a name (RBAC sees no name on a create).
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
# Reading and renewing: only the operator's own Lease.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: [{{ include "sluice-operator.fullname" . | quote }}]
  verbs: ["get", "update"]
{{- end -}}
