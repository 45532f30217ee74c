"""(being written)"""

from fastapi import APIRouter

router = APIRouter(tags=["admin"])
