"""(filled by later work)"""
