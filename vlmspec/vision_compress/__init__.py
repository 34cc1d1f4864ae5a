"""Visual-token compressors and adaptors for VLM drafters (SpecVLM, ViSpec). Not built yet: issue #5."""
