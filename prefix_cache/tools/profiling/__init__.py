"""Where a step's time goes: py-spy and torch profiles (`profile`, `profile_capture`), the
engine thread's step trace (`step_trace`) and the device's (`device_trace`)."""
