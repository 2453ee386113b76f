{{/* Names, labels and the kvc command lines shared by the templates. */}}

{{- define "kvc.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvc.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvc.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "kvc.agentImage" -}}
{{- printf "%s:%s" .Values.agentImage.repository (.Values.agentImage.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* KVC_<SERVICE>_REDIS_URL from redis.existingSecret; call with (list . "CONDUCTOR"). */}}
{{- define "kvc.redisSecretEnv" -}}
{{- $root := index . 0 -}}
{{- with $root.Values.redis.existingSecret }}
- name: KVC_{{ index $ 1 }}_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ . | quote }}
      key: {{ $root.Values.redis.existingSecretKey | quote }}
{{- end }}
{{- end -}}

{{/* The conductor's bearer keys and tenants file from auth.existingSecret. */}}
{{- define "kvc.authEnv" -}}
{{- $auth := .Values.auth -}}
{{- if and $auth.tenantsFileKey (not $auth.existingSecret) -}}
{{- fail "auth.tenantsFileKey needs auth.existingSecret" -}}
{{- end -}}
{{- with $auth.existingSecret }}
- name: KVC_CONDUCTOR_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ . | quote }}
      key: {{ $auth.apiKeysKey | quote }}
      optional: true
- name: KVC_CONDUCTOR_ADMIN_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ . | quote }}
      key: {{ $auth.adminKeysKey | quote }}
      optional: true
{{- if $auth.tenantsFileKey }}
- name: KVC_CONDUCTOR_TENANTS_FILE
  value: /etc/kvc/tenants/tenants.yaml
{{- end }}
{{- end }}
{{- end -}}

{{- define "kvc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "kvc.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* The headless Service (and StatefulSet) name of one node pool. */}}
{{- define "kvc.poolName" -}}
{{- printf "%s-%s" (include "kvc.fullname" .root) .pool.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Every agent's gRPC address, comma-separated: the conductors' static list. */}}
{{- define "kvc.agentAddresses" -}}
{{- $root := . -}}
{{- $addresses := list -}}
{{- range $pool := .Values.nodes -}}
{{- $svc := include "kvc.poolName" (dict "root" $root "pool" $pool) -}}
{{- range $i := until (int $pool.replicas) -}}
{{- $addresses = append $addresses (printf "%s-%d.%s.%s.svc:%d" $svc $i $svc $root.Release.Namespace (int $root.Values.agent.grpcPort)) -}}
{{- end -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{/* The model folder flag, when one is set (empty: the image's packaged model). */}}
{{- define "kvc.modelArgs" -}}
{{- if .Values.model.path }}
- --model
- {{ .Values.model.path | quote }}
{{- end }}
- --served-model-name
- {{ .Values.model.servedName | quote }}
{{- end -}}

{{- define "kvc.modelVolumeMount" -}}
{{- if .Values.model.volume.persistentVolumeClaim }}
- name: model
  mountPath: {{ .Values.model.volume.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "kvc.modelVolume" -}}
{{- if .Values.model.volume.persistentVolumeClaim }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.volume.persistentVolumeClaim }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* The Secret with the mTLS files: tls.existingSecret, else the chart's own. */}}
{{- define "kvc.tlsSecretName" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "kvc.fullname" .)) -}}
{{- end -}}

{{/* KVC_<SERVICE>_TLS_* (or the explicit plaintext switch when tls.enabled is false);
call with (list . "CONDUCTOR" "conductor"). */}}
{{- define "kvc.tlsEnv" -}}
{{- $root := index . 0 -}}
{{- $svc := index . 1 -}}
{{- $role := index . 2 -}}
{{- if $root.Values.tls.enabled }}
- name: KVC_{{ $svc }}_TLS_CERT_FILE
  value: /etc/kvc/tls/{{ $role }}.pem
- name: KVC_{{ $svc }}_TLS_KEY_FILE
  value: /etc/kvc/tls/{{ $role }}-key.pem
- name: KVC_{{ $svc }}_TLS_CA_FILE
  value: /etc/kvc/tls/ca.pem
{{- else }}
- name: KVC_{{ $svc }}_GRPC_PLAINTEXT
  value: any
{{- end }}
{{- end -}}

{{- define "kvc.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/kvc/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* Only the role's own certificate and key, and the CA; call with (list . "agent"). */}}
{{- define "kvc.tlsVolume" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- if $root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "kvc.tlsSecretName" $root | quote }}
    defaultMode: 0440
    items:
      - key: ca.pem
        path: ca.pem
      - key: {{ $role }}.pem
        path: {{ $role }}.pem
      - key: {{ $role }}-key.pem
        path: {{ $role }}-key.pem
{{- end }}
{{- end -}}
