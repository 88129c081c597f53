"""Kubernetes as a launch target: a Kubeflow Trainer v2 TrainJob sized by the plan.

docs/kubernetes.md has the user's side."""
