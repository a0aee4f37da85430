{{/* The parts of a role's pod that differ by role: ports, probes, resources, volumes. */}}

{{/* Roles that load the model (and so mount it and its cache). */}}
{{- define "pdserve.loadsModel" -}}
{{- if has .role (list "tokenizer" "prefill" "decode") }}true{{ end }}
{{- end }}

{{- define "pdserve.metricsPort" -}}
{{- if has .role (list "prefill" "decode") }}
{{- include "pdserve.flagValue" (index (index .root.Values .role "flags") "metrics-port" | default 0) }}
{{- else }}0{{ end }}
{{- end }}

{{/* The main port's name: the gateway speaks HTTP, every other role gRPC. */}}
{{- define "pdserve.portName" -}}
{{- if eq .role "gateway" }}http{{ else }}grpc{{ end }}
{{- end }}

{{- define "pdserve.containerPorts" -}}
{{- $flags := include "pdserve.roleFlags" . | fromYaml }}
- name: {{ include "pdserve.portName" . }}
  containerPort: {{ include "pdserve.flagValue" $flags.port }}
  protocol: TCP
{{- $metrics := include "pdserve.metricsPort" . }}
{{- if ne $metrics "0" }}
- name: metrics
  containerPort: {{ $metrics }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* A probe's handler. kind: live (process answers) or ready (it can serve). The gateway's
/ready also needs a tokenizer and registered workers; a worker's gRPC server only starts once
its model is loaded, and reports SERVING for its service once it is registered. gRPC probes
take a port number, not a name. The kubelet's gRPC probe speaks plaintext only: with
tls.enabled the gRPC services are probed by TCP connect (listening = model loaded). */}}
{{- define "pdserve.probeHandler" -}}
{{- $flags := include "pdserve.roleFlags" . | fromYaml }}
{{- if eq .role "gateway" }}
httpGet:
  path: {{ if eq .kind "ready" }}/ready{{ else }}/health{{ end }}
  port: http
{{- else if .root.Values.tls.enabled }}
tcpSocket:
  port: {{ include "pdserve.portName" . }}
{{- else }}
grpc:
  port: {{ include "pdserve.flagValue" $flags.port }}
  {{- if eq .kind "ready" }}
  service: {{ printf "pdserve.v1.%s" (title .role) }}
  {{- end }}
{{- end }}
{{- end }}

{{/* startupProbe covers the model load, then liveness and readiness take over. */}}
{{- define "pdserve.probes" -}}
{{- $probes := index .root.Values .role "probes" }}
startupProbe:
  {{- include "pdserve.probeHandler" (dict "root" .root "role" .role "kind" "live") | trim | nindent 2 }}
  {{- toYaml $probes.startup | nindent 2 }}
livenessProbe:
  {{- include "pdserve.probeHandler" (dict "root" .root "role" .role "kind" "live") | trim | nindent 2 }}
  {{- toYaml $probes.liveness | nindent 2 }}
readinessProbe:
  {{- include "pdserve.probeHandler" (dict "root" .root "role" .role "kind" "ready") | trim | nindent 2 }}
  {{- toYaml $probes.readiness | nindent 2 }}
{{- end }}

{{/* The role's resources, with its GPUs: `gpus` per tensor-parallel rank (extended resources:
the limit is also the request). */}}
{{- define "pdserve.resources" -}}
{{- $v := index .root.Values .role }}
{{- $resources := deepCopy ($v.resources | default dict) }}
{{- $gpus := int ($v.gpus | default 0) }}
{{- if gt $gpus 0 }}
{{- $gpus = mul $gpus (include "pdserve.tensorParallelSize" . | int) }}
{{- $limits := $resources.limits | default dict }}
{{- $_ := set $limits "nvidia.com/gpu" $gpus }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{- define "pdserve.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /var/cache/pdserve
{{- if and (include "pdserve.loadsModel" .) .root.Values.model.volume.type }}
- name: model
  mountPath: {{ .root.Values.model.volume.mountPath }}
  readOnly: true
{{- end }}
{{- if index .root.Values .role "shmSize" }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- include "pdserve.tlsVolumeMount" .root }}
{{- end }}

{{- define "pdserve.volumes" -}}
{{- $vol := .root.Values.model.volume }}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- if and (include "pdserve.loadsModel" .) $vol.type }}
- name: model
  {{- if eq $vol.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $vol.claimName }}
    readOnly: true
  {{- else }}
  hostPath:
    path: {{ $vol.hostPath }}
    type: Directory
  {{- end }}
{{- end }}
{{- with index .root.Values .role "shmSize" }}
# torch's inter-process tensors and NCCL's buffers between tensor-parallel ranks live in
# /dev/shm, which a container gets only 64 MiB of.
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ . }}
{{- end }}
{{- include "pdserve.tlsVolume" .root }}
{{- end }}
