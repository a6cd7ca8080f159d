"""redbatch.preproc_worker"""
