{{/* Labels on every object of the control plane. */}}
{{- define "meshlet.labels" -}}
app.kubernetes.io/part-of: meshlet
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
meshlet.io/control-plane-ns: {{ .Release.Namespace }}
{{- end -}}

{{- define "meshlet.tag" -}}
{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "meshlet.controllerImage" -}}
{{ .Values.image.registry }}/controller:{{ include "meshlet.tag" . }}
{{- end -}}

{{- define "meshlet.proxyImage" -}}
{{ .Values.image.registry }}/proxy:{{ include "meshlet.tag" . }}
{{- end -}}

{{/* A required PEM value, with the fix in the message. */}}
{{- define "meshlet.pem" -}}
{{- $v := index . 0 -}}{{- $name := index . 1 -}}
{{- if not (contains "-----BEGIN" $v) -}}
{{- fail (printf "%s must be PEM; `meshlet install` generates it, or pass it with --values" $name) -}}
{{- end -}}
{{ $v }}
{{- end -}}

{{/*
The pod template metadata of a control-plane component. `meshlet install` meshes these pods
with the injector's own patch (the injector cannot inject itself or its siblings): the
annotations below are what it reads.
*/}}
{{- define "meshlet.podMetadata" -}}
{{- $root := index . 0 -}}{{- $component := index . 1 -}}
labels:
  {{- include "meshlet.labels" $root | nindent 2 }}
  app.kubernetes.io/name: {{ $component }}
  meshlet.io/control-plane-component: {{ $component }}
annotations:
  meshlet.io/inject: enabled
  {{- if eq $component "tap" }}
  {{- /* It speaks mTLS to proxies' tap port itself. */}}
  config.meshlet.io/skip-outbound-ports: {{ printf "%s,4190" $root.Values.proxyInit.kubeAPIServerPorts | quote }}
  {{- else }}
  config.meshlet.io/skip-outbound-ports: {{ $root.Values.proxyInit.kubeAPIServerPorts | quote }}
  {{- end }}
  {{- /* Proxies must reach the control plane whatever the mesh's default inbound policy. */}}
  config.meshlet.io/default-inbound-policy: all-unauthenticated
  {{- if eq $component "identity" }}
  {{- /* Its proxy is certified by the container next to it: it must not hold it back, nor
  wait for it (a classic sidecar's postStart hook would wait for a certificate only the
  container after it can issue). And it serves TLS itself, to proxies that have no
  certificate yet: its port is not redirected (its proxy would terminate TLS addressed to the
  identity it shares). */}}
  config.meshlet.io/proxy-native-sidecar: "false"
  config.meshlet.io/proxy-await: disabled
  config.meshlet.io/skip-inbound-ports: "8080"
  {{- end }}
{{- end -}}

{{/* The controller container's common parts. */}}
{{- define "meshlet.controller" -}}
{{ include "meshlet.controllerContainer" (list . .Values.controllerResources) }}
{{- end -}}

{{/* The same, with the component's own resources. */}}
{{- define "meshlet.controllerContainer" -}}
{{- $root := index . 0 -}}{{- $resources := index . 1 -}}
image: {{ include "meshlet.controllerImage" $root }}
imagePullPolicy: {{ $root.Values.image.pullPolicy }}
securityContext:
  allowPrivilegeEscalation: false
  capabilities:
    drop: [ALL]
  readOnlyRootFilesystem: true
  runAsNonRoot: true
  runAsUser: 2103
  runAsGroup: 2103
  seccompProfile:
    type: RuntimeDefault
resources:
  {{- toYaml $resources | nindent 2 }}
{{- end -}}

{{- define "meshlet.probes" -}}
readinessProbe:
  httpGet:
    path: /ready
    port: admin-http
  periodSeconds: 5
livenessProbe:
  httpGet:
    path: /live
    port: admin-http
  initialDelaySeconds: 10
{{- end -}}

{{/* A controller Deployment's rollout strategy (deploymentStrategy; empty: Kubernetes'). */}}
{{- define "meshlet.strategy" -}}
{{- with .Values.deploymentStrategy }}
strategy:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
A controller pod's anti-affinity (enablePodAntiAffinity), as Linkerd's HA mode: never two
replicas of a component on one node, and across zones where the nodes have them.
*/}}
{{- define "meshlet.affinity" -}}
{{- $root := index . 0 -}}{{- $component := index . 1 -}}
{{- if $root.Values.enablePodAntiAffinity }}
affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - labelSelector:
          matchLabels:
            meshlet.io/control-plane-component: {{ $component }}
        topologyKey: kubernetes.io/hostname
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          labelSelector:
            matchLabels:
              meshlet.io/control-plane-component: {{ $component }}
          topologyKey: topology.kubernetes.io/zone
{{- end }}
{{- end -}}
