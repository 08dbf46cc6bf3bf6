"""The files the agent reads: its settings, the profile configs (mig-parted's v1 format),
the device plugin's config, and YAML read strictly. The only YAML parsing in the package."""
