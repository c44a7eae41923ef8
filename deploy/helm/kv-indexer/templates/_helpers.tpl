{{- define "kv-indexer.labels" -}}
app.kubernetes.io/name: kv-indexer
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}
{{- define "kv-indexer.selector" -}}
app.kubernetes.io/name: kv-indexer
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
