{{/* The name of every object of the release. */}}
{{- define "gdr.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gdr.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gdr.labels" -}}
{{ include "gdr.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "gdr.facadeUrl" -}}
{{- .Values.facade.url | default (printf "https://%s.%s.svc:%v" (include "gdr.fullname" .) .Release.Namespace .Values.facade.port) -}}
{{- end -}}

{{- define "gdr.spiffeId" -}}
{{- .Values.facade.spiffeId | default (printf "spiffe://%s/ci/controller" .Values.identity.trustDomain) -}}
{{- end -}}

{{/* Where the secret files appear in the controller. */}}
{{- define "gdr.secretDir" -}}/etc/gitea-dynamic-runner/secrets{{- end -}}

{{/* Whether the Service exposes the HTTP port (metrics, health, the webhook): only for a
ServiceMonitor or the webhook, so job Pods do not reach it otherwise. */}}
{{- define "gdr.serviceMonitor" -}}
{{- if and .Values.metrics.serviceMonitor.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor") }}true{{ end -}}
{{- end -}}
{{- define "gdr.exposeHttp" -}}
{{- if or .Values.gitea.webhook (include "gdr.serviceMonitor" .) }}true{{ end -}}
{{- end -}}

{{/* The jobs' cache in a directory of its own volume: the embedded store without a bucket. */}}
{{- define "gdr.cacheVolume" -}}
{{- if and .Values.cache.enabled (eq .Values.store.kind "embedded") (not .Values.cache.s3.bucket) }}true{{ end -}}
{{- end -}}
