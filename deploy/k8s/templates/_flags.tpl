{{/* Service flags: which ones each role takes, how values' flag maps merge, and their env. */}}

{{/* The flags each `pdserve <role>` takes that values may set (`pdserve <role> --help`, less
the chart-managed ones below). tests/test_helm_chart.py holds these lists equal to the services'
parsers, so a new flag fails CI until it is added here. */}}
{{- define "pdserve.knownFlags" -}}
gateway: [port, log-level, drain-timeout, served-model-name, local-prefill-max-tokens,
  max-concurrent-requests, max-body-bytes, trust-request-chat-template, redis-namespace,
  max-migrations, resume-ttl-seconds, resume-write-interval-ms, response-ttl-seconds, keep-alive-seconds, tls-cert,
  tls-key, tls-ca, tls-server-name, enable-auto-tool-choice, tool-call-parser, routing,
  enable-lora, lora-modules, reuse-port, generate-streams, prefill-streams]
tokenizer: [port, log-level, drain-timeout, model, served-model-name, max-model-len,
  redis-namespace, tls-cert, tls-key, tls-ca, tls-server-name, chat-template]
prefill: [port, log-level, drain-timeout, redis-namespace, tls-cert, tls-key, tls-ca,
  tls-server-name, metrics-port, model, served-model-name, max-model-len,
  dtype, kv-cache-dtype, quantization, device, block-size, kv-cache-memory, num-kv-blocks,
  gpu-memory-utilization,
  max-num-seqs, max-num-batched-tokens, no-prefix-caching, seed, stream-interval,
  distributed-timeout-seconds,
  speculative-config, kv-slab-bytes, kv-lease-seconds, kv-transport, kv-push-streams,
  shared-gpu-step-marks, engine-core, enable-lora, lora-modules, max-loras, max-lora-rank, max-cpu-loras,
  enable-expert-parallel, enforce-eager, disable-log-stats, log-stats-interval]
decode: [port, log-level, drain-timeout, redis-namespace, tls-cert, tls-key, tls-ca,
  tls-server-name, metrics-port, model, served-model-name, max-model-len,
  dtype, kv-cache-dtype, quantization, device, block-size, kv-cache-memory, num-kv-blocks,
  gpu-memory-utilization,
  max-num-seqs, max-num-batched-tokens, no-prefix-caching, seed, stream-interval,
  distributed-timeout-seconds,
  speculative-config, kv-timeout, kv-wait-seconds, kv-wait-max-requests, kv-transport,
  kv-write-grace-seconds, kv-doorbell, shared-gpu-pace-ms, shared-gpu-pace-tokens,
  shared-gpu-step-marks,
  engine-core, enable-lora, lora-modules, max-loras,
  max-lora-rank, max-cpu-loras, enable-expert-parallel, enforce-eager, disable-log-stats,
  log-stats-interval]
{{- end }}

{{/* Flags that depend on where a pod runs, or on the pod's shape (tensor-parallel-size: its
GPUs, from <role>.tensorParallelSize): the chart sets them (pdserve.env), values may not. */}}
{{- define "pdserve.managedFlags" -}}host advertise-address redis-url tokenizer-address api-key tensor-parallel-size{{- end }}

{{/* A worker's tensor-parallel ranks, <role>.tensorParallelSize (null: 1); checked by
pdserve.checkTensorParallel. (dict "root" $ "role" "decode") */}}
{{- define "pdserve.tensorParallelSize" -}}
{{- $tp := index .root.Values .role "tensorParallelSize" }}
{{- if kindIs "invalid" $tp }}1{{ else }}{{ int $tp }}{{ end }}
{{- end }}

{{/* The values maps a role's flags come from, later ones winning. */}}
{{- define "pdserve.flagSources" -}}
{{- if eq .role "gateway" }}flags lora.flags gateway.flags
{{- else if eq .role "tokenizer" }}flags model.flags tokenizer.flags
{{- else }}flags model.flags engine.flags lora.flags {{ .role }}.flags
{{- end }}
{{- end }}

{{/* A role's merged flags as YAML (callers `fromYaml` it). A plain key-by-key `set`, not
sprig's merge, so that a later null, false or 0 still overrides an earlier value. */}}
{{- define "pdserve.roleFlags" -}}
{{- $root := .root }}
{{- $merged := dict }}
{{- range $source := splitList " " (include "pdserve.flagSources" .) }}
{{- $map := $root.Values }}
{{- range $key := splitList "." $source }}{{ $map = index $map $key | default dict }}{{ end }}
{{- range $k, $v := $map }}{{ $_ := set $merged $k $v }}{{ end }}
{{- end }}
{{- toYaml $merged }}
{{- end }}

{{/* A flag's value as the service parses it. Values arrive as float64 (YAML and JSON numbers
alike), which would print 536870912 as 5.36870912e+08: whole numbers print as integers. */}}
{{- define "pdserve.flagValue" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/* Whether a flag is set at all: null and "" leave the service's default. */}}
{{- define "pdserve.isSet" -}}
{{- if not (or (kindIs "invalid" .) (eq (toString .) "")) }}true{{ end }}
{{- end }}

{{/* PDSERVE_<FLAG>, the environment fallback the services read for --<flag>. */}}
{{- define "pdserve.envName" -}}
{{- printf "PDSERVE_%s" (. | upper | replace "-" "_") }}
{{- end }}

{{/* A container's env: pod facts, the chart-managed flags, then every flag set in values. */}}
{{- define "pdserve.env" -}}
{{- $flags := include "pdserve.roleFlags" . | fromYaml }}
# Workers and the tokenizer publish $(POD_IP):<port> in the registry; gateways dial it directly.
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: PDSERVE_HOST
  value: "0.0.0.0"
{{- if ne .role "gateway" }}
- name: PDSERVE_ADVERTISE_ADDRESS
  value: "$(POD_IP):{{ include "pdserve.flagValue" $flags.port }}"
{{- end }}
{{- include "pdserve.redisEnv" .root }}
{{- include "pdserve.tlsEnv" .root }}
{{- if has .role (list "prefill" "decode") }}
- name: PDSERVE_TENSOR_PARALLEL_SIZE
  value: {{ include "pdserve.tensorParallelSize" . | quote }}
{{- end }}
{{- if eq .role "gateway" }}
- name: PDSERVE_TOKENIZER_ADDRESS
  {{- $tokenizer := dict "root" .root "role" "tokenizer" }}
  value: {{ printf "%s:%s" (include "pdserve.roleName" $tokenizer) (include "pdserve.flagValue" (include "pdserve.roleFlags" $tokenizer | fromYaml).port) | quote }}
{{- with .root.Values.gateway.apiKeySecret }}{{ if .name }}
- name: PDSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- end }}
{{- range $k, $v := $flags }}{{ if include "pdserve.isSet" $v }}
- name: {{ include "pdserve.envName" $k }}
  value: {{ include "pdserve.flagValue" $v | quote }}
{{- end }}{{ end }}
# The root filesystem is read-only: model caches (GGUF conversions, Triton) live under $HOME.
- name: HOME
  value: /var/cache/pdserve
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}

{{/* PDSERVE_REDIS_URL: the chart's Redis (password from its Secret) or the external one. */}}
{{- define "pdserve.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: {{ include "pdserve.redisSecretKey" . }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "pdserve.roleName" (dict "root" . "role" "redis")) | quote }}
{{- else if .Values.redis.external.existingSecret }}
- name: PDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else }}
- name: PDSERVE_REDIS_URL
  value: {{ .Values.redis.external.url | quote }}
{{- end }}
{{- end }}
