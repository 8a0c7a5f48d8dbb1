{{/* The scrape jobs for meshlet, one definition for the ConfigMap given to an external
Prometheus (prometheus.scrapeConfig) and for the chart's own (prometheus.enabled): every
proxy's meshlet-admin port, labelled with its pod's namespace, name and workload labels, and
the control plane's admin-http ports, labelled with their component. Found by Prometheus'
Kubernetes discovery, or (prometheus.discovery=meshlet) by HTTP discovery from the
destination, which labels the targets as the relabelling below does. */}}
{{- define "meshlet.prometheus.scrapeConfigs" -}}
{{- if eq .Values.prometheus.discovery "meshlet" }}
{{- $destination := printf "http://meshlet-destination.%s.svc.%s:9996" .Release.Namespace .Values.clusterDomain }}
- job_name: meshlet-proxy
  http_sd_configs:
    - url: {{ $destination }}/prometheus/proxies
      refresh_interval: {{ .Values.prometheus.scrapeInterval }}
- job_name: meshlet-controller
  http_sd_configs:
    - url: {{ $destination }}/prometheus/controllers
      refresh_interval: {{ .Values.prometheus.scrapeInterval }}
{{- else }}
- job_name: meshlet-proxy
  kubernetes_sd_configs:
    - role: pod
  relabel_configs:
    - source_labels: [__meta_kubernetes_pod_container_port_name]
      action: keep
      regex: ^meshlet-admin$
    - source_labels: [__meta_kubernetes_namespace]
      target_label: namespace
    - source_labels: [__meta_kubernetes_pod_name]
      target_label: pod
    - action: labelmap
      regex: __meta_kubernetes_pod_label_meshlet_io_proxy_(.+)
- job_name: meshlet-controller
  kubernetes_sd_configs:
    - role: pod
      namespaces:
        names: [{{ .Release.Namespace }}]
  relabel_configs:
    - source_labels: [__meta_kubernetes_pod_container_port_name]
      action: keep
      regex: ^admin-http$
    - source_labels: [__meta_kubernetes_pod_label_meshlet_io_control_plane_component]
      target_label: component
{{- end }}
{{- end -}}


{{/* The chart's own Prometheus' config file. */}}
{{- define "meshlet.prometheus.config" -}}
global:
  scrape_interval: {{ .Values.prometheus.scrapeInterval }}
  evaluation_interval: {{ .Values.prometheus.scrapeInterval }}
scrape_configs:
  {{- include "meshlet.prometheus.scrapeConfigs" . | nindent 2 }}
{{- end -}}
