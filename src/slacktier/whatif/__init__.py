"""whatif room: a placement's decode cost on devices this machine does not have.

    models.py  an emulated device's model: plan.readmodel's read model plus its queue depth and ranks in the fit
    fluid.py   the device as a fluid server: when each batch lands (pure)
    device.py  the emulated device, its TP-step clock, and the session that owns a run's devices
    lane.py    the lane compiled code records begin_step's batches in
    tier.py    the `emulated` tier (registered on import of this package)
    run.py     the what-if run: every TP rank's step timeline over emulated devices (`slacktier whatif`)
    report.py  its report, verdict and plot

Importing this package registers the `emulated` tier; nothing below this room knows it exists.
"""

from slacktier.whatif import tier as _tier  # noqa: F401  (registers tier "emulated")
from slacktier.whatif.device import DeviceSession, EmulatedDevice, current_session, device_session
from slacktier.whatif.fluid import SimJob, completions_ms
from slacktier.whatif.models import (BUILTIN_MODELS, NVME_PAPER, RDMA_PAPER, DeviceModel, device_model_toml,
                                     load_device_model, model_from_dict, this_disk_model)
from slacktier.whatif.tier import EmulatedOptions, EmulatedQueue, EmulatedSource

__all__ = ["BUILTIN_MODELS", "DeviceModel", "DeviceSession", "EmulatedDevice", "EmulatedOptions", "EmulatedQueue",
           "EmulatedSource", "NVME_PAPER", "RDMA_PAPER", "SimJob", "completions_ms", "current_session",
           "device_model_toml", "device_session", "load_device_model", "model_from_dict", "this_disk_model"]
