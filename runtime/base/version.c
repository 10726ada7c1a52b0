/* version.c - every program's --version (version.h). */
#include "version.h"

#include <stdio.h>
#include <string.h>

#ifndef AM_BUILT_WITH
#define AM_BUILT_WITH "unknown (built without configure)"
#endif

bool am_version_option(int argc, char **argv, const char *prog)
{
    if (argc < 2 || strcmp(argv[1], "--version") != 0)
        return false;
    printf("%s (am) %s\nbuilt with: %s\n", prog, PACKAGE_VERSION, AM_BUILT_WITH);
    return true;
}
