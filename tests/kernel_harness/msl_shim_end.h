// Included after the generated kernel text: drop the MSL keyword macros so
// the glue and driver code below see plain C++ again.
#undef device
#undef constant
#undef thread
#undef threadgroup
#undef kernel
