{{/* The chart name, overridable. */}}
{{- define "mcp-run.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every resource name: DNS label, at most 63 characters. */}}
{{- define "mcp-run.fullname" -}}
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

{{- define "mcp-run.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object, without the component. */}}
{{- define "mcp-run.commonLabels" -}}
helm.sh/chart: {{ include "mcp-run.chart" . }}
app.kubernetes.io/name: {{ include "mcp-run.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mcp-run
{{- end }}

{{/* Labels of the gateway's objects. */}}
{{- define "mcp-run.labels" -}}
{{ include "mcp-run.commonLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{/* Labels that select the gateway's pods (never change them on upgrade). */}}
{{- define "mcp-run.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mcp-run.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{/* The labels the gateway puts on every runner pod (see src/exec/kube). */}}
{{- define "mcp-run.runnerSelectorLabels" -}}
app.kubernetes.io/name: mcp-run
app.kubernetes.io/component: runner
app.kubernetes.io/managed-by: mcp-run
{{- end }}

{{- define "mcp-run.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mcp-run.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Where runner pods go. */}}
{{- define "mcp-run.runnerNamespace" -}}
{{- if .Values.runner.sameNamespace }}
{{- .Release.Namespace }}
{{- else }}
{{- default (printf "%s-runners" .Release.Name) .Values.runner.namespace }}
{{- end }}
{{- end }}

{{- define "mcp-run.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "mcp-run.authSecretName" -}}
{{- default (printf "%s-auth" (include "mcp-run.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* The gateway configuration file, with what the chart decides filled in. */}}
{{- define "mcp-run.config" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $server := merge (dict "listen" (printf "0.0.0.0:%d" (int .Values.containerPort)) "backend" "kube") (default dict $cfg.server) }}
{{- /* The gateway answers only to the names it is reached by (DNS-rebinding protection): the
     Service's names, and loopback for port-forwards; config.server.allowed_hosts replaces
     the list (add an ingress host there, or `*`). */}}
{{- if not (hasKey $server "allowed_hosts") }}
{{- $svc := include "mcp-run.fullname" . }}
{{- $ns := .Release.Namespace }}
{{- $_ := set $server "allowed_hosts" (list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) "localhost" "127.0.0.1" "::1") }}
{{- end }}
{{- /* Without tokens the gateway refuses a non-loopback listener unless told: with
     auth.enabled false the chart says so (NetworkPolicies are then the only guard). */}}
{{- if not .Values.auth.enabled }}
{{- $_ := set $server "insecure_no_auth" true }}
{{- end }}
{{- /* Replicas find each other from the headless Service's EndpointSlices and talk on
     their own port, with the generated (or given) peer secret (docs/deployment.md
     "Scaling"). */}}
{{- if .Values.peers.enabled }}
{{- $_ := set $server "peer_listen" (printf "0.0.0.0:%d" (int .Values.peers.port)) }}
{{- $_ := set $server "peer_service" (include "mcp-run.peerServiceName" .) }}
{{- $_ := set $server "peer_secret_file" "/etc/mcp-run/peer/secret" }}
{{- end }}
{{- $kube := merge (dict "namespace" (include "mcp-run.runnerNamespace" .) "instance" .Release.Name) (default dict $cfg.kubernetes) }}
{{- $_ := set $cfg "server" $server }}
{{- $_ := set $cfg "kubernetes" $kube }}
{{- if .Values.auth.enabled }}
{{- /* With auth on, a missing token file must stop the gateway rather than open it. */}}
{{- $_ := set $cfg "auth" (dict "required" true) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{- define "mcp-run.peerServiceName" -}}
{{- printf "%s-peers" (include "mcp-run.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mcp-run.peerSecretName" -}}
{{- if .Values.peers.existingSecret }}{{ .Values.peers.existingSecret }}{{ else }}{{ printf "%s-peer" (include "mcp-run.fullname" .) | trunc 63 | trimSuffix "-" }}{{ end }}
{{- end }}
