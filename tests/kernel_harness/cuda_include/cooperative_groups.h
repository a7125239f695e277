// Emulator stand-in: generated CUDA sources alias this namespace.
#pragma once
namespace cooperative_groups {}
