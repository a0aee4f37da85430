{{/* Names, labels and the image: what every template shares. */}}

{{/* The roles, in start order; each has a Deployment, a Service and a values section. */}}
{{- define "pdserve.roles" -}}tokenizer prefill decode gateway{{- end }}

{{- define "pdserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or the release name alone when it already contains the chart name.
Short enough that "-tokenizer" still fits a 63-character object name. */}}
{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The object name of a role: (dict "root" $ "role" "prefill") */}}
{{- define "pdserve.roleName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .role }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* Labels every pod of the release carries, whatever its role (NetworkPolicy peers). */}}
{{- define "pdserve.releaseLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* A role's image: the global `image` with the role's own `image` keys on top. */}}
{{- define "pdserve.imageSettings" -}}
{{- $image := deepCopy .root.Values.image }}
{{- range $k, $v := (index .root.Values .role "image" | default dict) }}
{{- $_ := set $image $k $v }}
{{- end }}
{{- toYaml $image }}
{{- end }}

{{- define "pdserve.image" -}}
{{- $image := include "pdserve.imageSettings" . | fromYaml }}
{{- $tag := $image.tag | default (printf "%s-%s" .root.Chart.AppVersion $image.variant) }}
{{- printf "%s:%s" $image.repository $tag }}
{{- end }}
