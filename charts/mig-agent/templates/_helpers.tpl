{{/* The name of every object of the release (ServiceAccount, roles, DaemonSet, policies). */}}
{{- define "mig-agent.name" -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "mig-agent.labels" -}}
app.kubernetes.io/name: {{ include "mig-agent.name" . }}
{{- end -}}

{{/* A CEL string literal; only characters that need no escaping (deploy/policies.py cel). */}}
{{- define "mig-agent.cel" -}}
{{- if not (regexMatch "^[A-Za-z0-9._/:-]+$" .) -}}
{{- fail (printf "cannot put %q into an admission policy" .) -}}
{{- end -}}
'{{ . }}'
{{- end -}}

{{- define "mig-agent.celList" -}}
{{- $out := list -}}
{{- range . -}}{{- $out = append $out (include "mig-agent.cel" .) -}}{{- end -}}
[{{ join ", " $out }}]
{{- end -}}

{{/* The agent's annotations (mig_agent.settings.Settings). */}}
{{- define "mig-agent.annotations" -}}
{{- $p := .Values.annotationPrefix -}}
{{- list (printf "%s/cordoned" $p) (printf "%s/paused-operands" $p) (printf "%s/reason" $p) (printf "%s/gpu-state" $p) (printf "%s/reboot-attempted" $p) (printf "%s/post-apply-pending" $p) (printf "%s/stopped-host-services" $p) (printf "%s/observed-plan" $p) (printf "%s/guard" $p) | toJson -}}
{{- end -}}

{{/* CEL true for the GPU Operator's validator pods the agent deletes (deploy/policies.py
     validator_match), false with gpuOperator.restartValidators off. */}}
{{- define "mig-agent.validatorMatch" -}}
{{- if .Values.gpuOperator.restartValidators -}}
variables.labels.?app.orValue('') in ['nvidia-cuda-validator', 'nvidia-device-plugin-validator', 'nvidia-operator-validator']
{{- else -}}
false
{{- end -}}
{{- end -}}

{{/* CEL true when the map `variables.labels` matches the device plugin's equality-based
     selector (deploy/policies.py selector_match). */}}
{{- define "mig-agent.pluginMatch" -}}
{{- $re := `^\s*(!?)\s*([A-Za-z0-9._/-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9._-]*))?\s*$` -}}
{{- $l := "variables.labels" -}}
{{- $terms := list -}}
{{- range splitList "," . -}}
{{- $neg := regexReplaceAll $re . "${1}" -}}
{{- $op := regexReplaceAll $re . "${3}" -}}
{{- if or (not (regexMatch $re .)) (and $neg $op) -}}
{{- fail (printf "device plugin selector %q: only key, !key, key=value and key!=value are supported in the policy" $) -}}
{{- end -}}
{{- $key := include "mig-agent.cel" (regexReplaceAll $re . "${2}") -}}
{{- $value := regexReplaceAll $re . "${4}" -}}
{{- if not $op -}}
{{- $terms = append $terms (printf "%s(%s in %s)" (ternary "!" "" (eq $neg "!")) $key $l) -}}
{{- else if eq $op "!=" -}}
{{- $terms = append $terms (printf "(!(%s in %s) || %s[%s] != '%s')" $key $l $l $key $value) -}}
{{- else -}}
{{- $terms = append $terms (printf "(%s in %s && %s[%s] == '%s')" $key $l $l $key $value) -}}
{{- end -}}
{{- end -}}
{{- join " && " $terms -}}
{{- end -}}

{{/* "true" when the agent handles DRA nodes: dra.enabled true, or auto and NVIDIA's
     DeviceClass gpu.nvidia.com exists (a lookup at install or upgrade; `helm template` sees
     no cluster: off); "" otherwise. */}}
{{- define "mig-agent.draEnabled" -}}
{{- $e := toString .Values.dra.enabled -}}
{{- if eq $e "auto" -}}
{{- if lookup "resource.k8s.io/v1" "DeviceClass" "" "gpu.nvidia.com" -}}true{{- end -}}
{{- else if eq $e "true" -}}true
{{- end -}}
{{- end -}}

{{/* CEL true for the DRA kubelet plugin's pod the agent deletes (deploy/policies.py
     dra_match), false with DRA off. */}}
{{- define "mig-agent.draMatch" -}}
{{- if include "mig-agent.draEnabled" . -}}
(request.namespace == {{ include "mig-agent.cel" .Values.dra.namespace }} && {{ include "mig-agent.pluginMatch" .Values.dra.selector }})
{{- else -}}
false
{{- end -}}
{{- end -}}

{{/* The setting-dependent parts of the admission policies (deploy/policies.py render), as JSON. */}}
{{- define "mig-agent.policyValues" -}}
{{- $v := .Values -}}
{{- $ann := include "mig-agent.annotations" . | fromJsonArray -}}
{{- $labelFields := list -}}
{{- range prepend $v.labels.operands $v.labels.state -}}{{- $labelFields = append $labelFields (printf "f:%s" .) -}}{{- end -}}
{{- $annFields := list -}}
{{- range $ann -}}{{- $annFields = append $annFields (printf "f:%s" .) -}}{{- end -}}
{{- $cond := include "mig-agent.cel" $v.conditionType | trimPrefix "'" | trimSuffix "'" -}}
{{- dict
  "agent_user" (printf "system:serviceaccount:%s:%s" .Release.Namespace (include "mig-agent.name" .))
  "state_label" (include "mig-agent.cel" $v.labels.state)
  "operand_labels" (include "mig-agent.celList" $v.labels.operands)
  "annotations" (include "mig-agent.celList" $ann)
  "gpu_state_annotation" (include "mig-agent.cel" (index $ann 3) | trimPrefix "'" | trimSuffix "'")
  "condition_type" $cond
  "plugin_namespace" (include "mig-agent.cel" $v.devicePlugin.namespace | trimPrefix "'" | trimSuffix "'")
  "plugin_selector" $v.devicePlugin.selector
  "taint_key" (include "mig-agent.cel" (printf "%s/mig-change" $v.annotationPrefix) | trimPrefix "'" | trimSuffix "'")
  "label_fields" (include "mig-agent.celList" $labelFields)
  "annotation_fields" (include "mig-agent.celList" $annFields)
  "condition_field" (printf "'k:{\"type\":\"%s\"}'" $cond)
  "plugin_match" (include "mig-agent.pluginMatch" $v.devicePlugin.selector)
  "validator_match" (include "mig-agent.validatorMatch" .)
  "dra_match" (include "mig-agent.draMatch" .)
  "dra_selector" (ternary (printf "%s, %s" $v.dra.namespace $v.dra.selector) "none: dra is off" (eq (include "mig-agent.draEnabled" .) "true"))
  | toJson -}}
{{- end -}}
