"""What calls cost and what they would have cost: prices per model and date (`prices`), the cache
simulator (`cachesim`), its calibration from recorded usage (`calibrate`), and the attribution of
prefix breaks to their cause (`breaks`)."""
