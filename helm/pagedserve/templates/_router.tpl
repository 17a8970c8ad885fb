{{/*
vLLM's router (vllm-router) in front of the replicas: names, labels and its
command line. docs/deployment.md explains each flag.
*/}}
{{- define "pagedserve.router.fullname" -}}
{{- printf "%s-router" (include "pagedserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagedserve.router.selectorLabels" -}}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end }}

{{- define "pagedserve.router.image" -}}
{{- printf "%s:%s" .Values.router.image.repository .Values.router.image.tag }}
{{- end }}

{{/*
"true" when the replicas publish KV cache events: the router is on with the
kv_aware policy. The endpoints are bound on every interface (the router
connects; networkpolicy.yaml admits only the router pods to them);
vllm-router 0.1.17 reads only the empty topic, so none is set. The router
finds them through each pod's GET /kv_event_sources, which needs a key once
keys are set unless open-kv-event-sources: the router holds none (it would
send it in place of the clients' keys on some routes, docs/deployment.md).
*/}}
{{- define "pagedserve.router.kvEvents" -}}
{{- if and .Values.router.enabled (eq .Values.router.policy "kv_aware") }}true{{ end }}
{{- end }}

{{- define "pagedserve.router.kvEventFlags" -}}
{{- $flags := dict }}
{{- if include "pagedserve.router.kvEvents" . }}
{{- $config := .Values.server.config }}
{{- if not (hasKey $config "kv-events-endpoint") }}
{{- $_ := set $flags "kv-events-endpoint" "tcp://*:5557" }}
{{- end }}
{{- if not (hasKey $config "kv-events-replay-endpoint") }}
{{- $_ := set $flags "kv-events-replay-endpoint" "tcp://*:5558" }}
{{- end }}
{{- if not (hasKey $config "open-kv-event-sources") }}
{{- $_ := set $flags "open-kv-event-sources" true }}
{{- end }}
{{- if get $config "kv-events-topic" }}
{{- fail "server.config.kv-events-topic must be empty with router.policy=kv_aware: vllm-router 0.1.17 reads only the empty topic" }}
{{- end }}
{{- end }}
{{- toYaml $flags }}
{{- end }}

{{/*
The TCP ports the replicas publish KV events and their replay on, as a YAML
list (empty: no events): from server.config, else the chart's endpoints.
*/}}
{{- define "pagedserve.kvEventPorts" -}}
{{- $flags := merge (deepCopy .Values.server.config) (include "pagedserve.router.kvEventFlags" . | fromYaml) }}
{{- $ports := list }}
{{- range $flag := list "kv-events-endpoint" "kv-events-replay-endpoint" }}
{{- $endpoint := get $flags $flag | default "" | toString }}
{{- if hasPrefix "tcp://" $endpoint }}
{{- $ports = append $ports (regexFind "[0-9]+$" $endpoint | int) }}
{{- end }}
{{- end }}
{{- toYaml $ports }}
{{- end }}

{{/*
The router's arguments. Workers come from Kubernetes service discovery: the
Ready pods of this release's server, in its namespace, on port 8000.
Per policy only the flags that policy reads:
  kv_aware     --router-temperature: the cost is in prompt tokens; a softmax at
               this temperature spreads cold prompts (equal cost, or a
               difference of a block or two) over the replicas and still sends
               a prompt whose long prefix one replica holds to that replica.
  cache_aware  --cache-threshold and the balance thresholds: above
               balanceAbsThreshold more requests in flight on one replica than
               on the least loaded (and balanceRelThreshold times as many), the
               router stops following the cache and picks the least loaded.
*/}}
{{- define "pagedserve.router.args" -}}
{{- $router := .Values.router -}}
- --host
- 0.0.0.0
- --port
- "8000"
- --service-discovery
- --selector
{{- range $key, $value := include "pagedserve.serverSelectorLabels" . | fromYaml }}
- {{ printf "%s=%s" $key $value | quote }}
{{- end }}
- --service-discovery-port
- "8000"
- --service-discovery-namespace
- {{ .Release.Namespace | quote }}
- --policy
- {{ $router.policy }}
{{- if eq $router.policy "kv_aware" }}
- --router-temperature
- {{ $router.temperature | quote }}
{{- else if eq $router.policy "cache_aware" }}
- --cache-threshold
- {{ $router.cacheThreshold | quote }}
- --balance-abs-threshold
- {{ $router.balanceAbsThreshold | quote }}
- --balance-rel-threshold
- {{ $router.balanceRelThreshold | quote }}
{{- end }}
- --health-check-interval-secs
- {{ $router.healthCheck.intervalSeconds | quote }}
- --health-failure-threshold
- {{ $router.healthCheck.failureThreshold | quote }}
- --prometheus-host
- 0.0.0.0
- --prometheus-port
- "29000"
{{- range $router.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
