{{/*
Names and labels shared by every template of the chart.
*/}}

{{/* The chart's name, overridable. */}}
{{- define "dynatrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name: RELEASE-dynatrain, or just RELEASE when it already contains the chart
name. Object names are DNS labels, hence the 63-character cut.
*/}}
{{- define "dynatrain.fullname" -}}
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

{{/* Labels on every object. */}}
{{- define "dynatrain.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "dynatrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dynatrain
{{- end }}

{{/* The operator pods' identity: the Deployment and the metrics Service select on these. */}}
{{- define "dynatrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dynatrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "dynatrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dynatrain.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "dynatrain.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The operator's rule on Secrets: in the ClusterRole, or in a Role per rbac.secretNamespaces.
By name only (get): it never lists or watches Secrets.
*/}}
{{- define "dynatrain.secretRule" -}}
# patch: each job's TLS Secrets (<job>-agent-pki, <job>-agent-tls) are rotated in place
# before their certificates expire (operator/pki.py); a kubelet then updates the mounted copy.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, delete, patch]
{{- end }}

{{/* "key=value,..." of a label map (sorted by key): the operator's flags' form. */}}
{{- define "dynatrain.labelsFlag" -}}
{{- $items := list }}
{{- range $k, $v := . }}
{{- $items = append $items (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $items }}
{{- end }}
