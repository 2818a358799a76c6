"""Measuring a draft: lossless speculative decoding (`speculative`), the decode chain (`chain`), held-out
teacher-forced metrics (`held_out`), `dflash eval` (`evaluate`) and the published format (`export`)."""
