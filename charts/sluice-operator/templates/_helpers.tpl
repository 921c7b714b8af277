{{/*
Names. Kubernetes names and label values stop at 63 characters, so every name is
truncated there and a trailing dash left by the cut is removed.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "sluice-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The full name of the release's objects: fullnameOverride, else "<release>-<chart>",
else just the release name when it already contains the chart name.
*/}}
{{- define "sluice-operator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A name derived from the full name plus a suffix, still within 63 characters. */}}
{{- define "sluice-operator.suffixed" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $base := include "sluice-operator.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" -}}
{{- printf "%s-%s" $base $suffix -}}
{{- end -}}

{{/* "chart-version" for the helm.sh/chart label ('+' is not allowed in label values). */}}
{{- define "sluice-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "sluice-operator.labels" -}}
helm.sh/chart: {{ include "sluice-operator.chart" . }}
{{ include "sluice-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluice
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels that select the operator's pods; they never change across upgrades. */}}
{{- define "sluice-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "sluice-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sluice-operator.fullname" .) .Values.serviceAccount.name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The image reference: a digest wins over a tag; the tag defaults to appVersion. */}}
{{- define "sluice-operator.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* The image of models without spec.image (--model-image); the tag defaults to appVersion. */}}
{{- define "sluice-operator.modelImage" -}}
{{- printf "%s:%s" (required "modelImage.repository is required" .Values.modelImage.repository) (.Values.modelImage.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
The namespaces the operator watches when watch.allNamespaces is false: the list given,
else the release namespace. Returned as a JSON list (templates cannot return lists).
*/}}
{{- define "sluice-operator.watchNamespaces" -}}
{{- $list := .Values.watch.namespaces | default (list .Release.Namespace) -}}
{{- toJson (uniq $list) -}}
{{- end -}}

{{/*
The operator's environment (the ConfigMap's data): the release name and the model image
(--model-image's $SLUICE_OPERATOR_MODEL_IMAGE), then operator.env. Never empty, so the
checksum always has something to hash.
*/}}
{{- define "sluice-operator.configData" -}}
SLUICE_OPERATOR_RELEASE: {{ .Release.Name | quote }}
SLUICE_OPERATOR_MODEL_IMAGE: {{ include "sluice-operator.modelImage" . | quote }}
{{- range $k, $v := .Values.operator.env }}
{{ $k }}: {{ $v | quote }}
{{- end }}
{{- end -}}

{{/*
The live operator Deployment's pods do not elect a leader ("true" or ""): it exists (a helm
upgrade; `lookup` finds nothing under `helm template`) and its pod template lacks the
sluice.dev/leader-election annotation: a release from before leader election, or one with
leaderElection off. Such pods must never run beside electing ones (deployment.yaml).
*/}}
{{- define "sluice-operator.replacesNonElecting" -}}
{{- $live := lookup "apps/v1" "Deployment" .Release.Namespace (include "sluice-operator.fullname" .) -}}
{{- if and .Values.leaderElection.enabled $live -}}
{{- if ne (get (dig "spec" "template" "metadata" "annotations" (dict) $live) "sluice.dev/leader-election") "true" -}}
true
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The replicas the live operator Deployment runs (0 when there is none). */}}
{{- define "sluice-operator.liveReplicas" -}}
{{- $live := lookup "apps/v1" "Deployment" .Release.Namespace (include "sluice-operator.fullname" .) -}}
{{- $live | dig "spec" "replicas" 0 -}}
{{- end -}}

{{/*
The activator (scale to zero): Deployment and Service "<release>-activator"; the operator
keeps the ConfigMap "<release>-activator-models" with the models it may hold requests for.
*/}}
{{- define "sluice-operator.activatorName" -}}
{{- printf "%s-activator" .Release.Name | trunc 55 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels that select the activator's pods (also the operator's --activator-selector). */}}
{{- define "sluice-operator.activatorSelectorLabels" -}}
app.kubernetes.io/name: sluice-activator
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/component: activator
{{- end -}}

{{/* Labels on every activator object. */}}
{{- define "sluice-operator.activatorLabels" -}}
helm.sh/chart: {{ include "sluice-operator.chart" . }}
{{ include "sluice-operator.activatorSelectorLabels" . }}
app.kubernetes.io/version: {{ .Values.activator.image.tag | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluice
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "sluice-operator.activatorImage" -}}
{{- $img := .Values.activator.image -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository $img.tag -}}
{{- end -}}
{{- end -}}

{{/*
The router's master continuation key as a Secret volume (file `master`): the chart's own
Secret or activator.continuationKey.existingSecret. Mounted read-only in the router's pods
and the operator's, at /etc/sluice/continuation.
*/}}
{{- define "sluice-operator.continuationKeySecret" -}}
{{- include "sluice-operator.activatorName" . | trunc 46 | trimSuffix "-" | printf "%s-continuation-key" -}}
{{- end -}}

{{- define "sluice-operator.continuationKeyVolume" -}}
- name: continuation-key
  secret:
    {{- $key := .Values.activator.continuationKey }}
    {{- if $key.existingSecret }}
    secretName: {{ $key.existingSecret }}
    items:
      - key: {{ $key.existingSecretKey }}
        path: master
    {{- else }}
    secretName: {{ include "sluice-operator.continuationKeySecret" . }}
    items:
      - key: continuation-key
        path: master
    {{- end }}
    defaultMode: 0440
{{- end -}}
