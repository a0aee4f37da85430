{{/* Where the Redis password lives: a Secret of the user's, or the chart's own. */}}
{{- define "pdserve.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (include "pdserve.roleName" (dict "root" . "role" "redis")) }}
{{- end }}

{{- define "pdserve.redisSecretKey" -}}
{{- if .Values.redis.auth.existingSecret }}{{ .Values.redis.auth.existingSecretKey }}{{ else }}redis-password{{ end }}
{{- end }}
