"""kwok Stage documents: how simulated nodes and pods move through their lives.

kwok v0.8 ships no built-in stages when run as a plain binary: it refuses to start unless its config
holds at least one Stage. The stages here are written for this project's tests:

- nodes become Ready at once and keep what they were created with (labels, capacity and allocatable,
  including `nvidia.com/*` resources); liveness comes from node Leases (kwok's
  `--node-lease-duration-seconds`), so the status heartbeat is rare and cheap;
- pods on a simulated node become Running and Ready at once; pods of a Job complete;
- a pod being deleted disappears only after a delay, as when a kubelet stops its containers: by
  default `min(DEFAULT, grace period)`, or the duration in the pod annotation
  `DELETE_DELAY_ANNOTATION` (a Go duration such as "500ms" or "10s"). Draining therefore has
  something to wait for.

Template functions (`Now`, `NodeConditions`, `NodeIPsWith`, `PodIPsWith`, `Quote`, `YAML`) and
the JQ selector language are kwok's Stage API (kwok.x-k8s.io/v1alpha1).
"""

from __future__ import annotations

# Per-pod override of the deletion delay; the same key kwok's own "general" pod stages read.
DELETE_DELAY_ANNOTATION = "pod-delete.stage.kwok.x-k8s.io/delay"

# Both node stages write the same conditions: kwok's standard set (Ready, no pressure), stamped now.
_NODE_CONDITIONS = """\
{{ $now := Now }}
      {{ $since := or .metadata.creationTimestamp $now }}
      conditions:
      {{ range NodeConditions }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $since | Quote }}
        message: {{ .message | Quote }}
        reason: {{ .reason | Quote }}
        status: {{ .status | Quote }}
        type: {{ .type | Quote }}
      {{ end }}"""

_NODE_STAGES = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-initialize
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select(.type == "Ready") | .status'
      operator: NotIn
      values: ['True']
  next:
    statusTemplate: |
      __NODE_CONDITIONS__
      addresses:
      {{ with NodeIP }}
      - {address: {{ . | Quote }}, type: InternalIP}
      {{ end }}
      {{ with NodeName }}
      - {address: {{ . | Quote }}, type: Hostname}
      {{ end }}
      {{ with NodePort }}
      daemonEndpoints:
        kubeletEndpoint:
          Port: {{ . }}
      {{ end }}
      allocatable:
      {{ with .status.allocatable }}
      {{ YAML . 1 }}
      {{ else }}
        {cpu: "64", memory: 512Gi, pods: "110"}
      {{ end }}
      capacity:
      {{ with .status.capacity }}
      {{ YAML . 1 }}
      {{ else }}
        {cpu: "64", memory: 512Gi, pods: "110"}
      {{ end }}
      nodeInfo:
        architecture: amd64
        operatingSystem: linux
        kubeletVersion: {{ printf "kwok-%s" Version | Quote }}
        kubeProxyVersion: {{ printf "kwok-%s" Version | Quote }}
        containerRuntimeVersion: {{ printf "kwok-%s" Version | Quote }}
        kernelVersion: {{ printf "kwok-%s" Version | Quote }}
        osImage: kwok
        bootID: ""
        machineID: ""
        systemUUID: ""
      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-heartbeat
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - key: '.status.phase'
      operator: In
      values: [Running]
    - key: '.status.conditions.[] | select(.type == "Ready") | .status'
      operator: In
      values: ['True']
  # Leases keep the node alive for the node-lifecycle controller; this only refreshes the
  # conditions' heartbeat times now and then, as a kubelet does (every 5 minutes by default).
  delay:
    durationMilliseconds: 240000
    jitterDurationMilliseconds: 300000
  next:
    statusTemplate: |
      __NODE_CONDITIONS__
  immediateNextStage: true
"""

_POD_STAGES = """\
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-ready
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: DoesNotExist
    - key: '.status.phase'
      operator: In
      values: [Pending]
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
      {{ range .spec.readinessGates }}
      - {type: {{ .conditionType | Quote }}, status: "True", lastTransitionTime: {{ $now | Quote }}}
      {{ end }}
      containerStatuses:
      {{ range .spec.containers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: true
        started: true
        restartCount: 0
        state: {running: {startedAt: {{ $now | Quote }}}}
      {{ end }}
      initContainerStatuses:
      {{ range .spec.initContainers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: true
        restartCount: 0
        {{ if eq .restartPolicy "Always" }}
        started: true
        state: {running: {startedAt: {{ $now | Quote }}}}
        {{ else }}
        state:
          terminated:
            {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }},
             finishedAt: {{ $now | Quote }}}
        {{ end }}
      {{ end }}
      {{ with NodeIPsWith .spec.nodeName }}
      hostIP: {{ index . 0 | Quote }}
      hostIPs:
      {{ range . }}
      - ip: {{ . | Quote }}
      {{ end }}
      {{ end }}
      {{ $hostNet := or .spec.hostNetwork false }}
      {{ $uid := or .metadata.uid "" }}
      {{ $name := or .metadata.name "" }}
      {{ $ns := or .metadata.namespace "" }}
      {{ with PodIPsWith .spec.nodeName $hostNet $uid $name $ns }}
      podIP: {{ index . 0 | Quote }}
      podIPs:
      {{ range . }}
      - ip: {{ . | Quote }}
      {{ end }}
      {{ end }}
      phase: Running
      startTime: {{ $now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-complete
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: DoesNotExist
    - key: '.status.phase'
      operator: In
      values: [Running]
    - key: '.metadata.ownerReferences.[].kind'
      operator: In
      values: [Job]
  next:
    statusTemplate: |
      {{ $now := Now }}
      containerStatuses:
      {{ range .spec.containers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: false
        started: false
        restartCount: 0
        state:
          terminated:
            {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }},
             finishedAt: {{ $now | Quote }}}
      {{ end }}
      phase: Succeeded
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: Exists
  delay:
    # kwok reads a JQ result as a Go duration ("1500ms") or as a point in time. Without the
    # annotation: DEFAULT, but never later than the grace period's end (deletionTimestamp), like a
    # kubelet that kills what is still running when the grace period is over.
    durationMilliseconds: __DEFAULT_MS__
    durationFrom:
      expressionFrom: >-
        .metadata.annotations["__ANNOTATION__"]
        // ("\\([__DEFAULT_MS__, (((.metadata.deletionTimestamp | fromdateiso8601) - now) * 1000
        | floor)] | min)ms")
  next:
    delete: true
"""


def config(pod_delete_delay_ms: int = 2000) -> str:
    """The kwok config: node and pod Stages; pods go `pod_delete_delay_ms` after deletion starts."""
    pod = _POD_STAGES.replace("__DEFAULT_MS__", str(pod_delete_delay_ms)).replace(
        "__ANNOTATION__", DELETE_DELAY_ANNOTATION
    )
    return _NODE_STAGES.replace("__NODE_CONDITIONS__", _NODE_CONDITIONS) + pod
