"""The engine's start: the process's place among the devices (topology), meshes as DeviceMeshes, the random
streams, and the function mode the engine enters for the whole process (and the regions that step it aside)."""
