"""Import-only stand-in for Ray on the device machine: verl imports ray when it is imported, the
ray wheel (79 MB) exceeds the 64 MiB the device tool carries, and `verl-moe align` never calls Ray.
Any attribute other than the type verl names in annotations raises."""


class ObjectRef:  # verl.protocol annotates fields with ray.ObjectRef
    pass


def __getattr__(name):
    raise AttributeError(f"ray is not installed on this machine (import-only stand-in): ray.{name}")
