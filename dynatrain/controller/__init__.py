"""The controller core: device profiles (hardware, calibrate), the cost model (costmodel,
stagecost) and the layout solver over it (solver), policy and two-phase switch orchestration,
shared by the local runner (`dynatrain run`) and the Kubernetes operator."""
