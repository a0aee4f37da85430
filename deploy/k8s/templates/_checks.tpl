{{/* Values that cannot work together fail the render with a reason, rather than deploying
pods that crash-loop or silently ignore a setting. Included once, by deployments.yaml. */}}
{{- define "pdserve.checks" -}}
{{- include "pdserve.checkFlags" . }}
{{- include "pdserve.checkKVLayout" . }}
{{- include "pdserve.checkKVTransport" . }}
{{- include "pdserve.checkTensorParallel" . }}
{{- include "pdserve.checkGPUs" . }}
{{- include "pdserve.checkModel" . }}
{{- include "pdserve.checkScaling" . }}
{{- include "pdserve.checkRedis" . }}
{{- include "pdserve.checkTLS" . }}
{{- end }}

{{/* Every flag in values is one the role's service takes, and none is chart-managed. */}}
{{- define "pdserve.checkFlags" -}}
{{- $root := . }}
{{- $known := include "pdserve.knownFlags" . | fromYaml }}
{{- $managed := splitList " " (include "pdserve.managedFlags" .) }}
{{- range $role := splitList " " (include "pdserve.roles" .) }}
{{- $sources := include "pdserve.flagSources" (dict "root" $root "role" $role) | splitList " " | join ", " }}
{{- range $flag, $_ := include "pdserve.roleFlags" (dict "root" $root "role" $role) | fromYaml }}
{{- if eq $flag "tensor-parallel-size" }}
{{- fail (printf "--tensor-parallel-size comes from %s.tensorParallelSize (it sizes the pod's GPUs); remove it from %s" $role $sources) }}
{{- else if has $flag $managed }}
{{- fail (printf "--%s is set by the chart itself; remove it from %s" $flag $sources) }}
{{- else if not (has $flag (index $known $role)) }}
{{- fail (printf "pdserve %s has no flag --%s (set in %s)" $role $flag $sources) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A decode worker only accepts KV blocks laid out as its own cache. */}}
{{- define "pdserve.checkKVLayout" -}}
{{- $prefill := include "pdserve.roleFlags" (dict "root" . "role" "prefill") | fromYaml }}
{{- $decode := include "pdserve.roleFlags" (dict "root" . "role" "decode") | fromYaml }}
{{- range $flag := list "block-size" "dtype" "kv-cache-dtype" }}
{{- if ne (toString (index $prefill $flag)) (toString (index $decode $flag)) }}
{{- fail (printf "prefill and decode must share --%s (KV blocks move between them): prefill has %v, decode %v; set it in engine.flags" $flag (index $prefill $flag) (index $decode $flag)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* A worker exits at start on a --kv-transport it does not know: refuse it here instead. */}}
{{- define "pdserve.checkKVTransport" -}}
{{- $root := . }}
{{- range $role := list "prefill" "decode" }}
{{- $value := index (include "pdserve.roleFlags" (dict "root" $root "role" $role) | fromYaml) "kv-transport" }}
{{- if and (include "pdserve.isSet" $value) (not (has (toString $value) (list "auto" "grpc" "cuda_ipc" "nixl"))) }}
{{- fail (printf "%s's kv-transport must be auto, grpc, cuda_ipc or nixl, got %v" $role $value) }}
{{- end }}
{{- end }}
{{- end }}

{{/* A whole number of ranks, and a /dev/shm bigger than the container's 64 MiB for more than
one (NCCL and torch pass tensors between the ranks' processes through it). */}}
{{- define "pdserve.checkTensorParallel" -}}
{{- $root := . }}
{{- range $role := list "prefill" "decode" }}
{{- $v := index $root.Values $role }}
{{- $tp := index $v "tensorParallelSize" }}
{{- if and (not (kindIs "invalid" $tp)) (not (regexMatch "^[1-9][0-9]*$" (toString $tp))) }}
{{- fail (printf "%s.tensorParallelSize must be an integer >= 1, got %v" $role $tp) }}
{{- else if and (gt (include "pdserve.tensorParallelSize" (dict "root" $root "role" $role) | int) 1) (not $v.shmSize) }}
{{- fail (printf "%s.tensorParallelSize is %v: its ranks pass tensors through /dev/shm; set %s.shmSize (e.g. 1Gi)" $role $tp $role) }}
{{- end }}
{{- end }}
{{- end }}

{{/* One GPU per tensor-parallel rank, and only a CUDA image and device can use it; rank r runs
on cuda:(N+r) for a device cuda:N, and a pod sees its GPUs as cuda:0 on. */}}
{{- define "pdserve.checkGPUs" -}}
{{- $root := . }}
{{- range $role := list "prefill" "decode" }}
{{- $v := index $root.Values $role }}
{{- $gpus := int ($v.gpus | default 0) }}
{{- $device := toString (index (include "pdserve.roleFlags" (dict "root" $root "role" $role) | fromYaml) "device") }}
{{- $image := include "pdserve.imageSettings" (dict "root" $root "role" $role) | fromYaml }}
{{- if or (lt $gpus 0) (gt $gpus 1) }}
{{- fail (printf "%s.gpus must be 0 or 1 (GPUs per tensor-parallel rank: more per pod with %s.tensorParallelSize, more pods with %s.replicas), got %d" $role $role $role $gpus) }}
{{- else if and (eq $gpus 1) (eq $device "cpu") }}
{{- fail (printf "%s.gpus is 1 but %s.flags.device is cpu" $role $role) }}
{{- else if and (eq $gpus 1) (ne $image.variant "cuda") }}
{{- fail (printf "%s.gpus is 1 but its image variant is %s: use image.variant (or %s.image.variant) cuda" $role $image.variant $role) }}
{{- else if and (eq $gpus 0) (hasPrefix "cuda" $device) }}
{{- fail (printf "%s.flags.device is %s but %s.gpus is 0: the pod would get no GPU" $role $device $role) }}
{{- else if and (eq $gpus 1) (regexMatch "^cuda:[1-9][0-9]*$" $device) }}
{{- fail (printf "%s.flags.device is %s but the pod's GPUs are cuda:0 on (one per rank): use cuda or auto" $role $device) }}
{{- end }}
{{- end }}
{{- end }}

{{/* A model path on the model volume needs that volume, and the volume its source. */}}
{{- define "pdserve.checkModel" -}}
{{- $vol := .Values.model.volume }}
{{- $model := toString (.Values.model.flags.model | default "") }}
{{- if not (has $vol.type (list "" "pvc" "hostPath")) }}
{{- fail (printf "model.volume.type must be \"\", pvc or hostPath, got %q" $vol.type) }}
{{- else if and (eq $vol.type "pvc") (not $vol.claimName) }}
{{- fail "model.volume.type is pvc: set model.volume.claimName" }}
{{- else if and (eq $vol.type "hostPath") (not $vol.hostPath) }}
{{- fail "model.volume.type is hostPath: set model.volume.hostPath" }}
{{- else if and (eq $vol.type "") (hasPrefix (printf "%s/" (trimSuffix "/" $vol.mountPath)) $model) }}
{{- fail (printf "model.flags.model %s is under model.volume.mountPath but no model volume is set (model.volume.type)" $model) }}
{{- end }}
{{- end }}

{{/* Autoscaling bounds, and metrics ports where something reads them. */}}
{{- define "pdserve.checkScaling" -}}
{{- $root := . }}
{{- range $role := list "gateway" "prefill" "decode" }}
{{- $v := index $root.Values $role }}
{{- if and $v.autoscaling.enabled (lt (int $v.autoscaling.maxReplicas) (int $v.replicas)) }}
{{- fail (printf "%s.autoscaling.maxReplicas (%v) is below %s.replicas (%v), the HPA's minimum" $role $v.autoscaling.maxReplicas $role $v.replicas) }}
{{- end }}
{{- if ne $role "gateway" }}
{{- $port := int (index $v.flags "metrics-port" | default 0) }}
{{- if and (eq $port 0) (or $root.Values.serviceMonitor.enabled (and $v.autoscaling.enabled $v.autoscaling.customMetric.enabled)) }}
{{- fail (printf "%s.flags.metrics-port is 0 but serviceMonitor or %s.autoscaling.customMetric reads its metrics" $role $role) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Either the chart's Redis or an external one; a password that fits in a redis:// URL. */}}
{{- define "pdserve.checkRedis" -}}
{{- $redis := .Values.redis }}
{{- if and (not $redis.enabled) (not (or $redis.external.url $redis.external.existingSecret)) }}
{{- fail "redis.enabled is false: set redis.external.url or redis.external.existingSecret" }}
{{- end }}
{{- if and $redis.enabled $redis.auth.password (not (regexMatch "^[A-Za-z0-9._~-]+$" $redis.auth.password)) }}
{{- fail "redis.auth.password goes into a redis:// URL: use letters, digits and ._~- only" }}
{{- end }}
{{- end }}
