{{/*
Names. Kubernetes names are DNS labels of at most 63 characters.
*/}}
{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagedserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pagedserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels. The selector labels never change after install (a Deployment's
selector is immutable); the component label keeps the server's Service from
selecting the Redis pod of the same release.
*/}}
{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pagedserve.labels" -}}
helm.sh/chart: {{ include "pagedserve.chart" . }}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pagedserve
{{- end }}

{{- define "pagedserve.serverSelectorLabels" -}}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{- define "pagedserve.redisSelectorLabels" -}}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "pagedserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagedserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image: <repository>:<tag or appVersion>-<cpu|cuda>.
*/}}
{{- define "pagedserve.image" -}}
{{- $variant := ternary "cuda" "cpu" .Values.gpu.enabled }}
{{- printf "%s:%s-%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) $variant }}
{{- end }}

{{/*
Seconds Kubernetes waits between the preStop hook and SIGKILL: the preStop
sleep, the drain (shutdown-grace-seconds), then up to 5 s for uvicorn to flush
the last responses and 5 s of margin for the engine to stop.
*/}}
{{- define "pagedserve.terminationGracePeriodSeconds" -}}
{{- add (ceil .Values.server.shutdownGraceSeconds) .Values.preStopSleepSeconds 10 }}
{{- end }}

{{/*
The in-chart Redis.
*/}}
{{- define "pagedserve.redis.fullname" -}}
{{- printf "%s-redis" (include "pagedserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagedserve.redis.headless" -}}
{{- printf "%s-redis-headless" (include "pagedserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagedserve.redis.host" -}}
{{- printf "%s.%s.svc:6379" (include "pagedserve.redis.fullname" .) .Release.Namespace }}
{{- end }}

{{/*
The fleet's Redis URL when the chart knows it (an external redis.url, or the
in-chart Redis with no password or one given in values); "" otherwise. The
password is restricted by the schema to characters a URL carries verbatim.
*/}}
{{- define "pagedserve.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- if .Values.redis.auth.existingSecret }}
{{- else if .Values.redis.auth.password }}
{{- printf "redis://:%s@%s/0" .Values.redis.auth.password (include "pagedserve.redis.host" .) }}
{{- else }}
{{- printf "redis://%s/0" (include "pagedserve.redis.host" .) }}
{{- end }}
{{- else if .Values.redis.url }}
{{- .Values.redis.url }}
{{- end }}
{{- end }}

{{/*
The chart's Secret holds the API keys (unless existingSecret names one) and
whatever the chart knows of Redis. "true" when there is anything to hold.
*/}}
{{- define "pagedserve.secret.hasKeys" -}}
{{- if and (not .Values.existingSecret) (or .Values.apiKeys .Values.adminKeys) }}true{{ end }}
{{- end }}

{{- define "pagedserve.secret.enabled" -}}
{{- if or (include "pagedserve.secret.hasKeys" .) (include "pagedserve.redisUrl" .) }}true{{ end }}
{{- end }}

{{/*
The Secret the server reads PAGEDSERVE_API_KEYS / PAGEDSERVE_ADMIN_KEYS from;
"" when there are no keys at all.
*/}}
{{- define "pagedserve.keysSecretName" -}}
{{- if .Values.existingSecret }}
{{- .Values.existingSecret }}
{{- else if (or .Values.apiKeys .Values.adminKeys) }}
{{- include "pagedserve.fullname" . }}
{{- end }}
{{- end }}

{{/*
The Secret holding the in-chart Redis's password and its key; "" without one.
*/}}
{{- define "pagedserve.redis.passwordSecretName" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecret }}
{{- else if .Values.redis.auth.password }}
{{- include "pagedserve.fullname" . }}
{{- end }}
{{- end }}

{{- define "pagedserve.redis.passwordSecretKey" -}}
{{- ternary .Values.redis.auth.existingSecretPasswordKey "redisPassword" (ne .Values.redis.auth.existingSecret "") }}
{{- end }}

{{/*
storageClassName from a storageClass value: "" leaves it out (the cluster's
default class), "-" writes "" (no dynamic provisioning).
*/}}
{{- define "pagedserve.storageClass" -}}
{{- if eq . "-" }}
storageClassName: ""
{{- else if . }}
storageClassName: {{ . | quote }}
{{- end }}
{{- end }}
