{{/*
The operator's permissions, grouped by why it needs them, one comment per rule saying why.
They go into one ClusterRole when watch.allNamespaces is true, otherwise into a Role in
each watched namespace. Nothing is cluster-scoped beyond that: the operator turns kopf's
runtime CRD and namespace scanning off, never reads Secrets (it only writes router models'
continuation keys), and runs --standalone unless
peering is enabled. The end-to-end tests run the operator under exactly these rules.
docs/helm.md's RBAC table is generated from this file (`make crds`): each comment is its
rule's "why" there, and each `if .Values.x` block its "granted" column.
*/}}

{{- define "sluice-operator.rules.namespaced" -}}
# kopf lists and watches StreamingModels and patches its bookkeeping annotations onto them
# (`kopf.zalando.org/*`: last handled spec, handler progress).
- apiGroups: ["serving.sluice.dev"]
  resources: ["streamingmodels"]
  verbs: ["get", "list", "watch", "patch"]
# Status (phase, conditions, URLs) is written through the status subresource.
- apiGroups: ["serving.sluice.dev"]
  resources: ["streamingmodels/status"]
  verbs: ["get", "patch"]
# Children point at their StreamingModel with `blockOwnerDeletion`; where the
# OwnerReferencesPermissionEnforcement admission plugin is on (e.g. OpenShift), setting that
# needs update on the owner's finalizers.
- apiGroups: ["serving.sluice.dev"]
  resources: ["streamingmodels/finalizers"]
  verbs: ["update"]
# The model's Deployment: server-side applied (a patch that creates an object is also
# authorized as create) and watched, so hand edits and deletions are put back and its
# rollout shows in the status. Deleted only when a model moves to several nodes per replica
# (a LeaderWorkerSet replaces it); deleting a StreamingModel removes its children through
# owner references and the garbage collector.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Scale to zero (`autoscaling.minReplicas: 0`): the operator sets the replicas of an idle
# model's Deployment to 0, and to 1 when the activator holds requests for it, through the
# scale subresource (only `spec.replicas`; the HPA keeps 1..N).
- apiGroups: ["apps"]
  resources: ["deployments/scale"]
  verbs: ["patch"]
# The model's Service: as the Deployment (server-side applied, watched). Its ExternalName
# Service `<name>-activator` (models with `autoscaling.minReplicas: 0`, the route's backend
# while no replica is Ready) likewise, and deleted when minReplicas moves above 0.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The adapter list of models with LoRA on (`<name>-adapters`, mounted in their pods): as the
# Deployment, and deleted when LoRA is turned off. Only ConfigMaps with the operator's
# labels are watched; the operator never reads other ConfigMaps.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The continuation key of each router model whose streams migrate
# (`<name>-continuation-key`, mounted in its pods; docs/migration.md): server-side applied
# (a patch that creates is also authorized as create) and deleted when the model stops
# migrating. Never read, listed or watched: the operator writes the key it derives without
# reading anything back, and its own master key is a file the kubelet mounts.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "patch", "delete"]
# The Ingress: as the Deployment, and deleted when `spec.ingress.enabled` turns false.
- apiGroups: ["networking.k8s.io"]
  resources: ["ingresses"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The HPA: as the Deployment, and deleted when autoscaling is turned off or moves to KEDA
# (then KEDA's own `keda-hpa-<name>` is read for the status).
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The PodDisruptionBudget: as the Deployment, and deleted when at most one replica can run.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The model pods' NetworkPolicy (`spec.networkPolicy`): as the Deployment, and deleted when
# turned off; a router model's `<name>-kv-events` (its KV-event ports for the router's pods
# only, while the model's own is off) likewise.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The weights cache (`spec.model.cache.weights`): one download Job per claim, repository
# and revision, shared by the models that name the claim (so no owner reference), read by
# name while it runs; its pods are listed (the result is their termination message). A
# clean-up Job removes a revision nothing serves any more. A finished Job whose pods are
# gone is deleted and run again. Not watched: a download's progress is polled.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "create", "patch", "delete"]
# The weights cache's claim, created when `weights.create` is set and it does not exist;
# never deleted (other models may share it).
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create", "patch"]
# Gateway API HTTPRoutes for models with `spec.gateway`: read, server-side applied, deleted
# when a model moves back to an Ingress. Not watched (the Gateway API CRDs may be absent),
# so no list/watch; granting a resource a cluster does not serve is harmless.
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "create", "patch", "delete"]
# Gateway API Inference Extension InferencePools for models with
# `routing.inferencePool.enabled`: read, server-side applied, deleted when it is turned off.
# Not watched (the CRD may be absent), so no list/watch.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
# LeaderWorkerSets (LWS v0.10+) for models with `parallelism.nodes` above 1: read,
# server-side applied, deleted when a model moves back to one node (a Deployment). Not
# watched (the LWS CRD may be absent; the model's pods are), so no list/watch.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "create", "patch", "delete"]
# Scale to zero for models on several nodes per replica: the LeaderWorkerSet's scale
# subresource, as for the Deployment.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets/scale"]
  verbs: ["patch"]
# Read only: model pods are watched and kept in memory, so a pod turning Ready or Pending
# updates the status at once, and the status says why pods are Pending (PodScheduled
# condition, e.g. no free GPUs).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# Kubernetes Events on StreamingModels (invalid spec, applied children), posted by kopf and
# the operator.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.keda.enabled }}
# KEDA ScaledObjects for models with `autoscaling.backend: keda`: read, server-side applied,
# deleted when a model moves back to the HPA. Not watched (KEDA's CRD may be absent), so no
# list/watch.
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- if .Values.podMonitors.enabled }}
# Prometheus Operator PodMonitors for models with `observability.podMonitor.enabled`: read,
# server-side applied, deleted when the model turns it off. Not watched (the CRD may be
# absent), so no list/watch.
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- if .Values.peering.enabled }}
{{- if .Values.watch.allNamespaces }}
# Peering, cluster-wide: keep-alives in a ClusterKopfPeering (a higher-priority peer pauses
# the operator).
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- else }}
# Peering, per namespace: keep-alives in a KopfPeering (a higher-priority peer pauses the
# operator).
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
{{- if .Values.leaderElection.enabled }}
# Leader election (a Role in the release namespace): creating the Lease, which cannot be
# limited to a name (RBAC sees no name on a create).
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
# Leader election: reading and renewing (a PUT with the resourceVersion read) only the
# operator's own Lease.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: [{{ include "sluice-operator.fullname" . | quote }}]
  verbs: ["get", "update"]
{{- end }}
{{- end -}}

{{/*
The activator (activator.enabled): in a Role in the release namespace, where it runs. The
operator keeps one ConfigMap there, `<release>-activator-models` (the models the activator
may hold requests for), and finds the activator's pods to read their /metrics.
*/}}
{{- define "sluice-operator.rules.activator" -}}
{{- if .Values.activator.enabled }}
# Scale to zero: creating the activator's models ConfigMap (server-side apply of an object
# that does not exist yet), which cannot be limited to a name.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["create"]
# Scale to zero: reading and updating only the activator's models ConfigMap.
- apiGroups: [""]
  resources: ["configmaps"]
  resourceNames: [{{ include "sluice-operator.activatorName" . | printf "%s-models" | quote }}]
  verbs: ["get", "patch"]
# Scale to zero: listing the activator's pods in the release namespace, whose /metrics
# (held requests per model) tell the operator to scale a model to 1.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
{{- end }}
{{- end -}}
