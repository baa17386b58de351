{{/* Names and labels ---------------------------------------------------------- */}}

{{- define "lease-sidecar.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "lease-sidecar.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "lease-sidecar.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "lease-sidecar.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "lease-sidecar.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "lease-sidecar.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "lease-sidecar.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lease-sidecar.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "lease-sidecar.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "lease-sidecar.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "lease-sidecar.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{- define "lease-sidecar.injectorName" -}}
{{- printf "%s-injector" (include "lease-sidecar.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The sidecar ------------------------------------------------------------------
One definition, used by the example workload and rendered into the injector's spec, so
a chart-declared sidecar and an injected one are the same container. */}}

{{- define "lease-sidecar.stateDir" -}}/run/lease{{- end }}

{{/*
lease-sidecar.container: the sidecar as a native sidecar, for a pod's initContainers.
restartPolicy: Always makes it start before the app containers (once its startupProbe
passes) and stop after them, so the app never runs without it and the lease is released
after the app has stopped.
*/}}
{{- define "lease-sidecar.container" -}}
name: {{ .Values.sidecar.containerName }}
image: {{ include "lease-sidecar.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
restartPolicy: Always
args: ["run"]
ports:
  - name: lease-http
    containerPort: {{ .Values.sidecar.port }}
    protocol: TCP
env:
  - name: POD_NAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  - name: POD_NAMESPACE
    valueFrom:
      fieldRef:
        fieldPath: metadata.namespace
  - name: LEASE_BACKEND
    value: {{ .Values.lease.backend | quote }}
  - name: LEASE_NAME
    value: {{ .Values.lease.name | quote }}
  - name: LEASE_KEY_PREFIX
    value: {{ .Values.lease.keyPrefix | quote }}
  - name: LEASE_ROLE
    value: {{ .Values.lease.role | quote }}
  - name: LEASE_DURATION
    value: {{ .Values.lease.duration | quote }}
  {{- with .Values.lease.renewInterval }}
  - name: LEASE_RENEW_INTERVAL
    value: {{ . | quote }}
  {{- end }}
  - name: LEASE_CLAIM_HORIZON
    value: {{ .Values.lease.claimHorizon | quote }}
  - name: LEASE_POD_LABEL
    value: {{ .Values.lease.podLabel | quote }}
  - name: LEASE_HTTP_ADDR
    value: {{ include "lease-sidecar.httpAddr" . | quote }}
  - name: LEASE_STATE_DIR
    value: {{ include "lease-sidecar.stateDir" . | quote }}
  {{- if or .Values.lease.dsnSecret.name .Values.lease.dsn }}
  {{- /* Always from a Secret: the injector's ConfigMap carries this container, and
  a DSN never goes into a ConfigMap (templates/dsn-secret.yaml holds lease.dsn). */}}
  - name: LEASE_DSN
    valueFrom:
      secretKeyRef:
        name: {{ include "lease-sidecar.dsnSecretName" . }}
        key: {{ .Values.lease.dsnSecret.key | default "dsn" }}
  {{- end }}
  {{- with .Values.sidecar.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
volumeMounts:
  - name: lease-state
    mountPath: {{ include "lease-sidecar.stateDir" . }}
  - name: lease-sidecar-tmp
    mountPath: /tmp
startupProbe:
  httpGet:
    path: /healthz
    port: lease-http
  periodSeconds: 1
  failureThreshold: 30
livenessProbe:
  httpGet:
    path: /healthz
    port: lease-http
  periodSeconds: 10
  timeoutSeconds: 2
  failureThreshold: 3
readinessProbe:
  httpGet:
    path: {{ .Values.sidecar.readinessProbePath }}
    port: lease-http
  periodSeconds: 5
  timeoutSeconds: 2
{{- with .Values.sidecar.resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.sidecar.securityContext | nindent 2 }}
{{- end }}

{{- define "lease-sidecar.httpAddr" -}}
{{- $host := .Values.sidecar.listenAddress }}
{{- if contains ":" $host }}[{{ $host }}]:{{ .Values.sidecar.port }}
{{- else }}{{ $host }}:{{ .Values.sidecar.port }}
{{- end }}
{{- end }}

{{/* lease-sidecar.volumes: the pod volumes the sidecar needs (a list). lease-state is
shared with the app (it reads /run/lease/leader); memory-backed because it holds one
small file that must not outlive the pod. */}}
{{- define "lease-sidecar.volumes" -}}
- name: lease-state
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
- name: lease-sidecar-tmp
  emptyDir:
    sizeLimit: 16Mi
{{- end }}

{{/* lease-sidecar.appVolumeMount: how an app container mounts the lease directory. */}}
{{- define "lease-sidecar.appVolumeMount" -}}
name: lease-state
mountPath: {{ include "lease-sidecar.stateDir" . }}
readOnly: true
{{- end }}

{{/* lease-sidecar.appEnv: where an app container finds the answer (a list). */}}
{{- define "lease-sidecar.appEnv" -}}
- name: LEASE_LEADER_FILE
  value: {{ printf "%s/leader" (include "lease-sidecar.stateDir" .) | quote }}
- name: LEASE_LEADER_URL
  value: {{ printf "http://127.0.0.1:%d/leader" (int .Values.sidecar.port) | quote }}
{{- end }}

{{/* lease-sidecar.injectionSpec: what the injector adds to an opted-in pod (JSON). */}}
{{- define "lease-sidecar.injectionSpec" -}}
{{- $spec := dict
    "container" (include "lease-sidecar.container" . | fromYaml)
    "volumes" (include "lease-sidecar.volumes" . | fromYamlArray)
    "appMount" (include "lease-sidecar.appVolumeMount" . | fromYaml)
    "appEnv" (include "lease-sidecar.appEnv" . | fromYamlArray) -}}
{{- toPrettyJson $spec }}
{{- end }}

{{/* The Secret LEASE_DSN comes from: lease.dsnSecret.name, else the chart's own. */}}
{{- define "lease-sidecar.dsnSecretName" -}}
{{- .Values.lease.dsnSecret.name | default (printf "%s-dsn" (include "lease-sidecar.fullname" .) | trunc 63 | trimSuffix "-") }}
{{- end }}

{{/* lease-sidecar.leaseObjects: the Lease objects of this release, as a JSON list:
"{keyPrefix}.{name}" for every name of lease.name and rbac.leaseNames (the key the
kubernetes backend uses, sidecar/names.py). */}}
{{- define "lease-sidecar.leaseObjects" -}}
{{- $objects := list }}
{{- $names := concat (splitList "," .Values.lease.name) (.Values.rbac.leaseNames | default list) }}
{{- range $names }}
{{- $name := trim . }}
{{- if $name }}
{{- $object := ternary (printf "%s.%s" $.Values.lease.keyPrefix $name) $name (ne $.Values.lease.keyPrefix "") }}
{{- $objects = append $objects $object }}
{{- end }}
{{- end }}
{{- $objects | uniq | toJson }}
{{- end }}

{{/* Cluster-scoped, so it carries the namespace to stay unique across releases. */}}
{{- define "lease-sidecar.webhookConfigName" -}}
{{- printf "%s-%s" .Release.Namespace (include "lease-sidecar.injectorName" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
