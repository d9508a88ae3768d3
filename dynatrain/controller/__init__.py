"""The controller core: solver, policy and two-phase switch orchestration, shared by the
local runner (`dynatrain run`) and the Kubernetes operator."""
