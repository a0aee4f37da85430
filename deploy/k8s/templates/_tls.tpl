{{/* gRPC TLS (docs/security.md): one Secret, mounted read-only into every pdserve pod, its
files handed to --tls-cert, --tls-key and --tls-ca. The tokenizer and the workers serve TLS with
them (mutual: clients must present a certificate the CA signed); the gateway and the prefill
worker's KV push present them as clients. */}}

{{/* The Secret's keys (kubernetes.io/tls, plus the CA as cert-manager writes it) -> flags. */}}
{{- define "pdserve.tlsFiles" -}}
tls-cert: tls.crt
tls-key: tls.key
tls-ca: ca.crt
{{- end }}

{{- define "pdserve.tlsDir" -}}
{{- trimSuffix "/" .Values.tls.mountPath }}
{{- end }}

{{/* PDSERVE_TLS_CERT/KEY/CA pointing at the mounted files (every role; with tls.enabled). */}}
{{- define "pdserve.tlsEnv" -}}
{{- if .Values.tls.enabled }}
{{- $dir := include "pdserve.tlsDir" . }}
{{- range $flag, $file := include "pdserve.tlsFiles" . | fromYaml }}
- name: {{ include "pdserve.envName" $flag }}
  value: {{ printf "%s/%s" $dir $file | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "pdserve.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Only the three files, so a Secret without one of them keeps the pod from starting (the
kubelet names the missing key) instead of starting it without TLS. 0444: the image's user
(10001) reads them; the kubelet owns them as root. */}}
{{- define "pdserve.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0444
    items:
      {{- range $_, $file := include "pdserve.tlsFiles" . | fromYaml }}
      - key: {{ $file }}
        path: {{ $file }}
      {{- end }}
{{- end }}
{{- end }}

{{/* With tls.enabled the chart sets the TLS flags: a Secret to read them from, none in values. */}}
{{- define "pdserve.checkTLS" -}}
{{- $root := . }}
{{- if .Values.tls.enabled }}
{{- if not .Values.tls.secretName }}
{{- fail "tls.enabled is true: set tls.secretName (a kubernetes.io/tls Secret that also holds ca.crt)" }}
{{- end }}
{{- if not (hasPrefix "/" (toString .Values.tls.mountPath)) }}
{{- fail (printf "tls.mountPath must be an absolute path, got %q" (toString .Values.tls.mountPath)) }}
{{- end }}
{{- range $role := splitList " " (include "pdserve.roles" .) }}
{{- $flags := include "pdserve.roleFlags" (dict "root" $root "role" $role) | fromYaml }}
{{- range $flag, $_ := include "pdserve.tlsFiles" $root | fromYaml }}
{{- if include "pdserve.isSet" (index $flags $flag) }}
{{- fail (printf "--%s of %s is set from tls.secretName when tls.enabled is true; remove it from the flags" $flag $role) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
