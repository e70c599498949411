"""Local tools around the services, for a laptop run and for researchers: the demo, evaluation,
run reports, the local process supervisor (`rstar up`) and the tiny model's creation and stage-0
bootstrap. The services never import this package."""
