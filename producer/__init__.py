"""redbatch.producer"""
