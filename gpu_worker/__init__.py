"""redbatch.gpu_worker"""
