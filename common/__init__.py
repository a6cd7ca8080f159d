"""redbatch.common"""
