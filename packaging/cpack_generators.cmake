# Per-generator CPack settings (CPACK_PROJECT_CONFIG_FILE): the .deb installs under /usr; its
# compression comes from LORAPIPE_DEB_COMPRESSION: gzip by default (fast on gigabytes of NVIDIA
# libraries, and one of the compressions lintian accepts); xz is smaller but several times slower;
# zstd is fastest and smallest, and dpkg >= 1.21.18 (Debian 12, Ubuntu 22.04) installs it, but
# lintian calls it a malformed archive.
if(CPACK_GENERATOR STREQUAL "DEB")
  set(CPACK_PACKAGING_INSTALL_PREFIX "/usr")
  if(DEFINED ENV{LORAPIPE_DEB_COMPRESSION} AND NOT "$ENV{LORAPIPE_DEB_COMPRESSION}" STREQUAL "")
    set(CPACK_DEBIAN_COMPRESSION_TYPE "$ENV{LORAPIPE_DEB_COMPRESSION}")
  else()
    set(CPACK_DEBIAN_COMPRESSION_TYPE gzip)
  endif()
endif()
