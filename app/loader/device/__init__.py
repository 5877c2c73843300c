"""The hand-off to the device: transfer threads that turn filled slots into batches on the device
(transfer), and ``device_decode=`` (its settings in decode_settings, the batch decoder in device_decode)."""
