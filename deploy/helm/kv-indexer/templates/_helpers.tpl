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
{{- define "kv-indexer.replicationCheck" -}}
{{- if and (eq .Values.events.mode "bind") (not .Values.replication.enabled) -}}
{{- if and (eq .Values.mode "standalone") (gt (int .Values.replicaCount) 1) -}}
{{- fail "replicaCount > 1 in bind mode needs replication.enabled: each vLLM pod publishes to one replica, so without the shared log every replica scores with part of the fleet" -}}
{{- end -}}
{{- if and (eq .Values.mode "sidecar") (gt (int .Values.sidecar.eppReplicas) 1) -}}
{{- fail "sidecar.eppReplicas > 1 in bind mode needs replication.enabled: each vLLM pod publishes to one EPP pod's kv-indexer, so without the shared log every replica scores with part of the fleet" -}}
{{- end -}}
{{- end -}}
{{- end }}
{{- define "kv-indexer.endpointPickerCheck" -}}
{{- if and .Values.endpointPicker.enabled (ne .Values.mode "standalone") -}}
{{- fail "endpointPicker.enabled needs mode: standalone: in sidecar mode kv-indexer runs inside an EPP, which is the InferencePool's endpoint picker itself" -}}
{{- end -}}
{{- if .Values.endpointPicker.enabled -}}
{{- $tls := .Values.endpointPicker.tls -}}
{{- if not (or (eq $tls "selfSigned") (eq $tls "secret") (eq $tls "plaintext")) -}}
{{- fail "endpointPicker.tls must be selfSigned, secret or plaintext" -}}
{{- end -}}
{{- if and (eq $tls "secret") (not .Values.tls.existingSecret) -}}
{{- fail "endpointPicker.tls: secret needs tls.existingSecret" -}}
{{- end -}}
{{- if and .Values.endpointPicker.pool.name .Values.endpointPicker.endpoints -}}
{{- fail "endpointPicker: set pool or endpoints, not both (the pool's pods are the candidates)" -}}
{{- end -}}
{{- end -}}
{{- end }}
