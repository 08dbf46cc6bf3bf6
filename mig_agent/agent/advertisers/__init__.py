"""Who tells Kubernetes what the GPUs hold: NVIDIA's device plugin (``device_plugin``: node
resources) or NVIDIA's DRA kubelet plugin (``dra``: a ResourceSlice), behind one interface
(``advertiser``); ``plugin_start`` waits for a new plugin pod on a watch."""
