"""The controller core: calibrated device profiles (calibrate, over :mod:`dynatrain.spec.hardware`),
the cost model (costmodel, per stage :mod:`dynatrain.vps.stagecost`) and the layout solver over it
(solver), policy and two-phase switch orchestration,
shared by the local runner (`dynatrain run`) and the Kubernetes operator."""
