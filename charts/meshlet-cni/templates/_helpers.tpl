{{- define "meshletCni.labels" -}}
app.kubernetes.io/part-of: meshlet
app.kubernetes.io/name: meshlet-cni
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* meshlet-cni's settings: meshlet-init's flags by name (meshlet.init.cni.SETTINGS). */}}
{{- define "meshletCni.settings" -}}
{{- $s := dict "incoming-proxy-port" (toString .Values.inboundProxyPort) "outgoing-proxy-port" (toString .Values.outboundProxyPort) "proxy-uid" (toString .Values.proxyUID) "mode" .Values.iptablesMode -}}
{{- with .Values.ignoreInboundPorts }}{{ $_ := set $s "inbound-ports-to-ignore" (toString .) }}{{ end -}}
{{- with .Values.ignoreOutboundPorts }}{{ $_ := set $s "outbound-ports-to-ignore" (toString .) }}{{ end -}}
{{- with .Values.ignoreSubnets }}{{ $_ := set $s "subnets-to-ignore" . }}{{ end -}}
{{ toJson $s }}
{{- end -}}
