{{- /* What the Gateway API's own CRDs carry and meshlet's copies of them must too: the API server
refuses a CRD in a *.k8s.io group without api-approved.kubernetes.io; Gateway API controllers read
the bundle version and channel; Helm keeps the CRDs on uninstall, since other controllers' routes
may live in them. */ -}}
{{- define "meshlet.crds.gateway-annotations" -}}
annotations:
  api-approved.kubernetes.io: https://github.com/kubernetes-sigs/gateway-api/pull/2997
  gateway.networking.k8s.io/bundle-version: v1.2.1
  gateway.networking.k8s.io/channel: standard
  helm.sh/resource-policy: keep
{{- end }}

{{- /* The filters of the standard channel meshlet does not serve (an HTTPRoute of another
controller may use them): their shapes, so that the CRD accepts them. */ -}}
{{- define "meshlet.crds.gateway-filters" -}}
extensionRef:
  properties:
    group:
      maxLength: 253
      pattern: ^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$
      type: string
    kind:
      maxLength: 63
      minLength: 1
      pattern: ^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$
      type: string
    name:
      maxLength: 253
      minLength: 1
      type: string
  required:
  - group
  - kind
  - name
  type: object
requestMirror:
  properties:
    backendRef:
      properties:
        group:
          default: ''
          maxLength: 253
          pattern: ^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$
          type: string
        kind:
          default: Service
          maxLength: 63
          minLength: 1
          pattern: ^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$
          type: string
        name:
          maxLength: 253
          minLength: 1
          type: string
        namespace:
          maxLength: 63
          minLength: 1
          pattern: ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$
          type: string
        port:
          format: int32
          maximum: 65535
          minimum: 1
          type: integer
      required:
      - name
      type: object
  required:
  - backendRef
  type: object
urlRewrite:
  properties:
    hostname:
      maxLength: 253
      minLength: 1
      pattern: ^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$
      type: string
    path:
      properties:
        replaceFullPath:
          maxLength: 1024
          type: string
        replacePrefixMatch:
          maxLength: 1024
          type: string
        type:
          enum:
          - ReplaceFullPath
          - ReplacePrefixMatch
          type: string
      required:
      - type
      type: object
  type: object
{{- end }}
