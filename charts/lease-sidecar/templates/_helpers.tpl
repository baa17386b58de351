{{/* Names and labels ---------------------------------------------------------- */}}

{{- define "lease-sidecar.name" -}}
{{- $chart := "lease-sidecar" }}
{{- if include "lease-sidecar.ownChart" . }}{{ $chart = .Chart.Name }}{{ end }}
{{- default $chart .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "true" when .Chart is this chart's (also under an alias), "" in a context a parent
chart built with its own .Chart, or none. */}}
{{- define "lease-sidecar.ownChart" -}}
{{- with .Chart }}{{ with .Annotations }}{{ if index . "lease-sidecar/chart" }}true{{ end }}{{ end }}{{ end }}
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

{{/* The sidecar's ServiceAccount; public, like the templates below (a parent chart's pod
runs the sidecar as this account). */}}
{{- define "lease-sidecar.serviceAccountName" -}}
{{- include "lease-sidecar.call" (list "lease-sidecar.serviceAccountName" .) }}
{{- end }}

{{- define "lease-sidecar.serviceAccountName.body" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "lease-sidecar.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The images' tag: image.tag, else this chart's appVersion. In a context a parent chart
built (its own .Chart), .Chart.AppVersion would be the parent's: then the appVersion this
chart was released with (lease-sidecar.appVersion, kept equal to Chart.yaml by a test). */}}
{{- define "lease-sidecar.imageTag" -}}
{{- $tag := .Values.image.tag }}
{{- if not $tag }}
{{- $tag = include "lease-sidecar.appVersion" . }}
{{- if include "lease-sidecar.ownChart" . }}{{ $tag = .Chart.AppVersion }}{{ end }}
{{- end }}
{{- $tag }}
{{- end }}

{{/* The sidecar image: Dockerfile target `sidecar` (every backend but SQL Server, no
ODBC), or `sidecar-sqlserver` (the same plus pyodbc and the ODBC driver) when the lease
is in SQL Server. */}}
{{- define "lease-sidecar.image" -}}
{{- $repository := .Values.image.repository }}
{{- if eq .Values.lease.backend "sqlserver" }}
{{- $repository = .Values.image.sqlserverRepository | default "lease-sidecar-sqlserver" }}
{{- end }}
{{- $repository }}:{{ include "lease-sidecar.imageTag" . }}
{{- end }}

{{/* The operator image (Dockerfile target `operator`), same tag as the sidecar's. */}}
{{- define "lease-sidecar.operatorImage" -}}
{{- .Values.image.operatorRepository | default "lease-sidecar-operator" }}:{{ include "lease-sidecar.imageTag" . }}
{{- end }}

{{- define "lease-sidecar.appVersion" -}}0.1.0{{- end }}

{{- define "lease-sidecar.injectorName" -}}
{{- printf "%s-injector" (include "lease-sidecar.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The sidecar ------------------------------------------------------------------
One definition, used by the example workload and rendered into the injector's spec, so
a chart-declared sidecar and an injected one are the same container.

The public templates (lease-sidecar.container, .volumes, .appVolumeMount, .appEnv) work
from this chart and from a parent chart that depends on it:

  include "lease-sidecar.container" .                      # a parent's own context
  include "lease-sidecar.container" (index .Subcharts "lease-sidecar")
  include "lease-sidecar.container" (dict "Values" (index .Values "lease-sidecar") "Release" .Release)

lease-sidecar.call resolves the context: one holding this chart's values (sidecar, lease)
is used as it is; a parent's context is replaced by the context of its lease-sidecar
dependency (found by this chart's annotation, so an alias works too). */}}

{{- define "lease-sidecar.call" -}}
{{- $template := index . 0 }}
{{- $ctx := index . 1 }}
{{- $values := dict }}
{{- if kindIs "map" $ctx }}{{ $values = $ctx.Values | default dict }}{{ end }}
{{- if not (and (kindIs "map" $values) (hasKey $values "sidecar") (hasKey $values "lease")) }}
{{- $found := list }}
{{- $subcharts := dict }}
{{- if kindIs "map" $ctx }}{{ $subcharts = $ctx.Subcharts | default dict }}{{ end }}
{{- range $key, $sub := $subcharts }}
{{- if include "lease-sidecar.ownChart" $sub }}{{ $found = append $found $key }}{{ end }}
{{- end }}
{{- if ne (len $found) 1 }}
{{- if $found }}
{{- fail (printf "%s: this chart depends on lease-sidecar more than once (%s): pass one, e.g. include %q (index .Subcharts %q)" $template (join ", " (sortAlpha $found)) $template (first (sortAlpha $found))) }}
{{- end }}
{{- fail (printf "%s: no lease-sidecar values here: call it with the context of a chart that depends on lease-sidecar (.), with (index .Subcharts \"lease-sidecar\"), or with a dict holding \"Values\" (the lease-sidecar values) and \"Release\"" $template) }}
{{- end }}
{{- $ctx = index $subcharts (first $found) }}
{{- end }}
{{- include (printf "%s.body" $template) $ctx }}
{{- end }}

{{/* lease-sidecar.groupLabel: the lease-sidecar/group label the sidecar gives its pod
(sidecar.publish.pod_label.group_value of the first lease's key; an empty keyPrefix means
the default, as an empty LEASE_KEY_PREFIX does), for a pod template the chart renders
itself, so the pod has it from creation as injected pods do (docs/kubernetes.md#how-the-
sidecar-starts). Nothing with podLabel off. */}}
{{- define "lease-sidecar.groupLabel" -}}
{{- if ne .Values.lease.podLabel "off" }}
{{- $name := splitList "," .Values.lease.name | first | trim }}
{{- $key := printf "%s.%s" (.Values.lease.keyPrefix | default "lease-sidecar") $name }}
{{- if regexMatch "^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$" $key }}
lease-sidecar/group: {{ $key | quote }}
{{- else }}
{{- $head := regexReplaceAll "[^A-Za-z0-9_.-]" $key "-" | trunc 50 | trimAll "-_." }}
{{- $digest := sha256sum $key | trunc 12 }}
lease-sidecar/group: {{ ternary (printf "%s-%s" $head $digest) $digest (ne $head "") | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "lease-sidecar.stateDir" -}}/run/lease{{- end }}

{{/* lease-sidecar.shutdownHandover: LEASE_SHUTDOWN_HANDOVER as the sidecar gets it, "off"
or "youngest-ready". youngest-ready finds the group's pods by their labels and names a
pod as the successor, so it needs the pod label and the pod name as identity: auto picks
it only where both hold, and an explicit youngest-ready where one does not fails (called
by templates/validate.yaml too, so every render checks it). */}}
{{- define "lease-sidecar.shutdownHandover" -}}
{{- $handover := .Values.lease.shutdownHandover | default "auto" }}
{{- $ownIdentity := false }}
{{- range .Values.sidecar.extraEnv }}
{{- if eq .name "LEASE_IDENTITY" }}{{ $ownIdentity = true }}{{ end }}
{{- end }}
{{- $labelOff := eq .Values.lease.podLabel "off" }}
{{- if eq $handover "auto" }}
{{- $handover = ternary "off" "youngest-ready" (or $labelOff $ownIdentity) }}
{{- else if and (eq $handover "youngest-ready") $labelOff }}
{{- fail "lease.shutdownHandover=youngest-ready finds the group's pods by their labels: it needs lease.podLabel auto or on (or set lease.shutdownHandover to off or auto)" }}
{{- else if and (eq $handover "youngest-ready") $ownIdentity }}
{{- fail "lease.shutdownHandover=youngest-ready names a pod as the successor: it needs the pod name as identity, not LEASE_IDENTITY in sidecar.extraEnv (or set lease.shutdownHandover to off or auto)" }}
{{- end }}
{{- $handover }}
{{- end }}

{{/*
lease-sidecar.container: the sidecar as a native sidecar, for a pod's initContainers.
restartPolicy: Always makes it start before the app containers (once its postStart hook
or startupProbe has seen it answer) and stop after them, so the app never runs without it and the lease is released
after the app has stopped.
*/}}
{{- define "lease-sidecar.container" -}}
{{- include "lease-sidecar.call" (list "lease-sidecar.container" .) }}
{{- end }}

{{- define "lease-sidecar.container.body" -}}
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
  {{- with .Values.lease.appReadyContainers }}
  - name: LEASE_APP_READY_CONTAINERS
    value: {{ join "," . | quote }}
  {{- end }}
  {{- $handover := include "lease-sidecar.shutdownHandover" . }}
  {{- if ne $handover "off" }}
  - name: LEASE_SHUTDOWN_HANDOVER
    value: {{ $handover | quote }}
  {{- end }}
  {{- with .Values.lease.appUnreadyAfter }}
  - name: LEASE_APP_UNREADY_AFTER
    value: {{ . | quote }}
  {{- end }}
  {{- with .Values.lease.appReadyOutageGrace }}
  - name: LEASE_APP_READY_OUTAGE_GRACE
    value: {{ . | quote }}
  {{- end }}
  {{- if .Values.lease.controlToken }}
  - name: LEASE_CONTROL_TOKEN_FILE
    value: {{ printf "%s/control-token" (include "lease-sidecar.stateDir" .) | quote }}
  {{- end }}
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
{{- /* Startup and liveness: /livez, the loop runs (a restart can help). Readiness:
/healthz by default, which also fails while the sidecar can never lead (no credentials
for the kubernetes backend), where a restart cannot help. The app containers start once
the sidecar answers /livez: the kubelet starts them only after a native sidecar's
postStart hook (or its startupProbe) has passed. */}}
{{- if eq .Values.sidecar.startGate "postStart" }}
lifecycle:
  postStart:
    exec:
      command:
        - /opt/lease-sidecar/bin/python
        - -I
        - -S
        - -c
        - {{ include "lease-sidecar.waitServing" . | quote }}
{{- else }}
startupProbe:
  httpGet:
    path: /livez
    port: lease-http
  periodSeconds: 1
  failureThreshold: {{ .Values.sidecar.startTimeoutSeconds }}
{{- end }}
livenessProbe:
  httpGet:
    path: /livez
    port: lease-http
  periodSeconds: 10
  timeoutSeconds: 2
  failureThreshold: 3
readinessProbe:
  httpGet:
    path: {{ .Values.sidecar.readinessProbePath }}
    port: lease-http
  periodSeconds: {{ .Values.sidecar.readinessProbePeriodSeconds }}
  timeoutSeconds: 2
{{- with .Values.sidecar.resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.sidecar.securityContext | nindent 2 }}
{{- end }}

{{/* lease-sidecar.waitServing: the postStart hook's program (the image's Python, no
shell): wait until the sidecar answers GET /livez with 200 on its own port, at most
sidecar.startTimeoutSeconds; failing, the kubelet restarts the container, as a failed
startupProbe would. */}}
{{- define "lease-sidecar.waitServing" -}}
{{- $host := .Values.sidecar.listenAddress }}
{{- if eq $host "0.0.0.0" }}{{ $host = "127.0.0.1" }}{{ else if eq $host "::" }}{{ $host = "::1" }}{{ end -}}
import socket,sys,time
end=time.monotonic()+{{ .Values.sidecar.startTimeoutSeconds }}
while True:
  try:
    with socket.create_connection(({{ $host | quote }},{{ .Values.sidecar.port }}),2) as s:
      s.sendall(b"GET /livez HTTP/1.0\r\nHost: localhost\r\n\r\n")
      if s.makefile("rb").readline().split()[1:2]==[b"200"]: sys.exit(0)
  except OSError: pass
  if time.monotonic()>end: sys.exit("lease-sidecar: no answer from /livez in {{ .Values.sidecar.startTimeoutSeconds }} s")
  time.sleep(0.05)
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
{{- include "lease-sidecar.call" (list "lease-sidecar.volumes" .) }}
{{- end }}

{{- define "lease-sidecar.volumes.body" -}}
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
{{- include "lease-sidecar.call" (list "lease-sidecar.appVolumeMount" .) }}
{{- end }}

{{- define "lease-sidecar.appVolumeMount.body" -}}
name: lease-state
mountPath: {{ include "lease-sidecar.stateDir" . }}
readOnly: true
{{- end }}

{{/* lease-sidecar.appEnv: where an app container finds the answer (a list). */}}
{{- define "lease-sidecar.appEnv" -}}
{{- include "lease-sidecar.call" (list "lease-sidecar.appEnv" .) }}
{{- end }}

{{- define "lease-sidecar.appEnv.body" -}}
- name: LEASE_LEADER_FILE
  value: {{ printf "%s/leader" (include "lease-sidecar.stateDir" .) | quote }}
- name: LEASE_LEADER_URL
  value: {{ printf "http://127.0.0.1:%d/leader" (int .Values.sidecar.port) | quote }}
{{- end }}

{{/* lease-sidecar.injectionSpec: what the injector adds to an opted-in pod (JSON).
leaseObjects: the Leases the sidecar's Role grants when it grants only named ones, so
the injector refuses a pod naming another (its sidecar could never hold it); null when
any name works (rbac.anyLease), the chart makes no Role, or another backend. */}}
{{- define "lease-sidecar.injectionSpec" -}}
{{- $objects := include "lease-sidecar.leaseObjects" . | fromJsonArray }}
{{- $limited := and .Values.rbac.create (eq .Values.lease.backend "kubernetes") (not .Values.rbac.anyLease) }}
{{- $spec := dict
    "container" (include "lease-sidecar.container" . | fromYaml)
    "volumes" (include "lease-sidecar.volumes" . | fromYamlArray)
    "appMount" (include "lease-sidecar.appVolumeMount" . | fromYaml)
    "appEnv" (include "lease-sidecar.appEnv" . | fromYamlArray)
    "leaseObjects" (ternary $objects nil $limited) -}}
{{- toPrettyJson $spec }}
{{- end }}

{{/* The Secret LEASE_DSN comes from: lease.dsnSecret.name, else the chart's own. */}}
{{- define "lease-sidecar.dsnSecretName" -}}
{{- .Values.lease.dsnSecret.name | default (printf "%s-dsn" (include "lease-sidecar.fullname" .) | trunc 63 | trimSuffix "-") }}
{{- end }}

{{/* lease-sidecar.leaseObjects: the Lease objects of this release, as a JSON list:
"{keyPrefix}.{name}" for every name of lease.name and rbac.leaseNames (the key the
kubernetes backend uses, sidecar/base/names.py). */}}
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

{{/* The value of the namespace label lease-sidecar/injector that opts a namespace in to
this release's injector: "<release>.<namespace>", a valid label value (63 characters). */}}
{{- define "lease-sidecar.injectorId" -}}
{{- regexReplaceAll "[^A-Za-z0-9]+$" (printf "%s.%s" .Release.Name .Release.Namespace | trunc 63) "" }}
{{- end }}

{{/* The namespaces the sidecar's RBAC, Leases and DSN Secret go to, as a JSON list of
{"name", "serviceAccounts"}: the release namespace (the chart's ServiceAccount and
rbac.extraServiceAccounts), then injector.namespaces when the injector is on. */}}
{{- define "lease-sidecar.sidecarNamespaces" -}}
{{- $accounts := prepend (.Values.rbac.extraServiceAccounts | default list) (include "lease-sidecar.serviceAccountName" .) }}
{{- $result := list (dict "name" .Release.Namespace "serviceAccounts" ($accounts | uniq)) }}
{{- if .Values.injector.enabled }}
{{- range .Values.injector.namespaces }}
{{- if ne .name $.Release.Namespace }}
{{- $result = append $result (dict "name" .name "serviceAccounts" (.serviceAccounts | default (list "default") | uniq)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $result | toJson }}
{{- end }}

{{/* Cluster-scoped, so it carries the namespace to stay unique across releases. */}}
{{- define "lease-sidecar.webhookConfigName" -}}
{{- printf "%s-%s" .Release.Namespace (include "lease-sidecar.injectorName" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- /*
"true" when this release renders the pod-patch ValidatingAdmissionPolicy and its binding
(cluster-scoped; admissionregistration.k8s.io/v1 policies are GA from Kubernetes 1.30),
else empty. Used by templates/pod-patch-policy.yaml and the install-rights check in
templates/validate.yaml.
*/}}
{{- define "lease-sidecar.podPatchPolicy" -}}
{{- $supported := or (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") (semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version) }}
{{- if and .Values.rbac.create .Values.rbac.podPatchPolicy (ne .Values.lease.podLabel "off") $supported }}true{{ end }}
{{- end }}

{{- define "lease-sidecar.podPatchPolicyName" -}}
{{- printf "%s-%s-pod-patch" .Release.Namespace (include "lease-sidecar.fullname" .) }}
{{- end }}

{{- /*
The install-rights probes of templates/validate.yaml. Each looks up (GET by name, with
the installer's own credentials) a cluster-scoped object the release would create. An
installer without rights outside the release namespace gets "forbidden", which stops
helm install / upgrade before anything is created; helm reports the template's name with
the error, so the name is the message: the value to set. (helm template and --dry-run ask
the apiserver nothing, so they render as before.)
*/}}
{{- define "rbac.podPatchPolicy=true creates a cluster-scoped ValidatingAdmissionPolicy; without the right to, install with --set rbac.podPatchPolicy=false" -}}
{{- $_ := lookup "admissionregistration.k8s.io/v1" "ValidatingAdmissionPolicy" "" (include "lease-sidecar.podPatchPolicyName" .) }}
{{- end }}

{{- define "injector.enabled=true creates a cluster-scoped MutatingWebhookConfiguration and ClusterRole; without the right to, install with --set injector.enabled=false" -}}
{{- $_ := lookup "admissionregistration.k8s.io/v1" "MutatingWebhookConfiguration" "" (include "lease-sidecar.webhookConfigName" .) }}
{{- end }}
