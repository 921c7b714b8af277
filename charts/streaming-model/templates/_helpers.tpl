{{/* The StreamingModel's name: nameOverride or the release name, a DNS label (63 chars). */}}
{{- define "streaming-model.name" -}}
{{- default .Release.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The spec keys copied from values. Kept in step with the CRD by tests/chart (a new spec
field fails the test until it is listed here and documented in values.yaml).
*/}}
{{- define "streaming-model.specKeys" -}}
{{- toJson (list "model" "resources" "parallelism" "engine" "streaming" "auth" "replicas" "autoscaling" "disaggregation" "ingress" "gateway" "routing" "networkPolicy" "limits" "server" "adapters" "startup" "rollout" "observability" "image" "imagePullPolicy" "imagePullSecrets" "podLabels" "podAnnotations" "serviceAccountName") -}}
{{- end -}}

{{/* Labels on the StreamingModel (the operator adds its own to the children). */}}
{{- define "streaming-model.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "streaming-model.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluice
{{- with .Values.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}
