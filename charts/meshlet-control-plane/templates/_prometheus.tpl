{{/* The scrape jobs for meshlet, one definition for the ConfigMap given to an external
Prometheus (prometheus.scrapeConfig) and for the chart's own (prometheus.enabled): every
proxy's meshlet-admin port, labelled with its pod's namespace, name and workload labels, and
the control plane's admin-http ports, labelled with their component. */}}
{{- define "meshlet.prometheus.scrapeConfigs" -}}
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
{{- end -}}


{{/* The chart's own Prometheus' config file. */}}
{{- define "meshlet.prometheus.config" -}}
global:
  scrape_interval: {{ .Values.prometheus.scrapeInterval }}
  evaluation_interval: {{ .Values.prometheus.scrapeInterval }}
scrape_configs:
  {{- include "meshlet.prometheus.scrapeConfigs" . | nindent 2 }}
{{- end -}}
