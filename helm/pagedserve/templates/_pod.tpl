{{/*
Pieces of the server's pod spec, kept here so that deployment.yaml reads as
the pod it describes.
*/}}

{{/*
Secrets reach the server as environment variables, never as flags (a flag
shows in the process list). Every reference is optional: a key left out of
an existingSecret means "not set", not a pod stuck in CreateContainerConfigError.
*/}}
{{- define "pagedserve.secretEnv" -}}
{{- $root := .root }}
{{- with .keysSecret }}
- name: PAGEDSERVE_API_KEYS
  valueFrom:
    secretKeyRef: {name: {{ . }}, key: apiKeys, optional: true}
- name: PAGEDSERVE_ADMIN_KEYS
  valueFrom:
    secretKeyRef: {name: {{ . }}, key: adminKeys, optional: true}
{{- end }}
{{- if and $root.Values.redis.enabled $root.Values.redis.auth.existingSecret }}
{{- /* The chart never sees this password: Kubernetes splices it into the URL. */}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.redis.auth.existingSecret }}
      key: {{ $root.Values.redis.auth.existingSecretPasswordKey }}
- name: PAGEDSERVE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s/0" (include "pagedserve.redis.host" $root) | quote }}
{{- else if include "pagedserve.redisUrl" $root }}
- name: PAGEDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ include "pagedserve.fullname" $root }}, key: redisUrl}
{{- else if $root.Values.existingSecret }}
- name: PAGEDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ $root.Values.existingSecret }}, key: redisUrl, optional: true}
{{- end }}
{{- end }}

{{/*
resources, plus the GPU limit with gpu.enabled (extended resources are
requested through limits alone).
*/}}
{{- define "pagedserve.resources" -}}
{{- $resources := deepCopy (default dict .Values.resources) }}
{{- if .Values.gpu.enabled }}
{{- $limits := default dict $resources.limits }}
{{- $_ := set $limits .Values.gpu.resourceName .Values.gpu.count }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/*
The model cache at /cache ($XDG_CACHE_HOME of the image).
*/}}
{{- define "pagedserve.cacheVolume" -}}
{{- $persistence := .Values.modelCache.persistence }}
{{- if $persistence.enabled }}
persistentVolumeClaim:
  claimName: {{ default (printf "%s-cache" (include "pagedserve.fullname" .)) $persistence.existingClaim }}
{{- else if .Values.modelCache.emptyDir.sizeLimit }}
emptyDir:
  sizeLimit: {{ .Values.modelCache.emptyDir.sizeLimit }}
{{- else }}
emptyDir: {}
{{- end }}
{{- end }}

{{/*
Where the pods may run: the values' constraints, plus the GPU node selector
and tolerations with gpu.enabled.
*/}}
{{- define "pagedserve.scheduling" -}}
{{- $nodeSelector := deepCopy (default dict .Values.nodeSelector) }}
{{- $tolerations := default list .Values.tolerations }}
{{- if .Values.gpu.enabled }}
{{- $nodeSelector = merge $nodeSelector .Values.gpu.nodeSelector }}
{{- $tolerations = concat $tolerations .Values.gpu.tolerations }}
{{- end }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The flags the chart sets in config.yaml; server.config overrides them.
tensor-parallel-size follows gpu.count, and may not ask for more GPUs than
the pod gets; the KV event endpoints come with router.policy=kv_aware.
*/}}
{{- define "pagedserve.chartFlags" -}}
{{- $flags := dict "shutdown-grace-seconds" .Values.server.shutdownGraceSeconds }}
{{- $gpus := int (ternary .Values.gpu.count 0 .Values.gpu.enabled) }}
{{- if and (gt $gpus 1) (not (hasKey .Values.server.config "tensor-parallel-size")) }}
{{- $_ := set $flags "tensor-parallel-size" $gpus }}
{{- end }}
{{- $size := int (get .Values.server.config "tensor-parallel-size" | default 1) }}
{{- if and .Values.gpu.enabled (gt $size $gpus) }}
{{- fail (printf "server.config.tensor-parallel-size=%d needs %d GPUs per pod, but gpu.count=%d" $size $size $gpus) }}
{{- end }}
{{- /* KV cache events for the router's kv_aware policy (_router.tpl). */}}
{{- $flags = merge $flags (include "pagedserve.router.kvEventFlags" . | fromYaml) }}
{{- toYaml $flags }}
{{- end }}

{{/*
Tensor-parallel ranks on several GPUs talk through NCCL, which needs more
shared memory than a container's default 64 MiB /dev/shm.
*/}}
{{- define "pagedserve.tensorParallel" -}}
{{- and .Values.gpu.enabled (gt (int .Values.gpu.count) 1) | ternary "true" "" }}
{{- end }}
