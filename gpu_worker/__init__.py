"""gpu_worker"""
