# Install rules and CPack settings (included from the top CMakeLists.txt): the layout both packages
# share, the LibTorch and NVIDIA libraries bundled from the wheel, desktop integration files, man
# pages, and the Debian package's metadata. `packaging/package.sh` builds the packages.
#
# Layout under the prefix (/usr in the .deb; the top folder of the .tar.gz):
#   bin/lorapipe, bin/lorapipe-cli          relative symlinks to lib/lorapipe/bin/
#   lib/lorapipe/bin/                       the executables (RPATH $ORIGIN/../lib)
#   lib/lorapipe/lib/                       LibTorch and the NVIDIA libraries it loads, from the wheel
#   share/applications, icons/hicolor, metainfo, mime/packages, man/man1
#   share/lorapipe/examples                 example projects
#   share/lorapipe/licenses/<component>/    licence texts of the bundled components
#   share/doc/lorapipe/                     Debian copyright and changelog
# The same relative layout in both packages keeps the .tar.gz relocatable: nothing refers to the
# prefix, only to $ORIGIN.
if(NOT TARGET lorapipe OR NOT TARGET lorapipe-cli)
  message(STATUS "packaging: the GUI is not built (LORAPIPE_BUILD_GUI=OFF); no install rules")
  return()
endif()

set(pkg_bin "lib/lorapipe/bin")
set(pkg_lib "lib/lorapipe/lib")
set_target_properties(lorapipe lorapipe-cli PROPERTIES INSTALL_RPATH "$ORIGIN/../lib")

# The wheel's folders: torch/lib and nvidia/*/lib.
get_filename_component(pkg_site "${TORCH_INSTALL_PREFIX}" DIRECTORY)

install(TARGETS lorapipe lorapipe-cli RUNTIME_DEPENDENCY_SET lorapipe_runtime RUNTIME DESTINATION ${pkg_bin})
# Everything the executables load from the wheel, followed through each library's own NEEDED and
# RPATH; system libraries (Qt, SQLite, glibc, ...) come from Debian packages (Depends below). The
# toolkit's libcudart (which the build links) is replaced by the wheel's newer one, the one
# libtorch_cuda was built against.
install(RUNTIME_DEPENDENCY_SET lorapipe_runtime DESTINATION ${pkg_lib}
        PRE_EXCLUDE_REGEXES "^libcudart\\.so"
        POST_INCLUDE_REGEXES "^${pkg_site}/"
        POST_EXCLUDE_REGEXES ".*")
# Loaded with dlopen, so no NEEDED names them: the CUDA runtime (above), NVRTC's builtins and
# LibTorch's NVRTC shim (for kernels LibTorch compiles at run time). cuDNN's engine libraries
# (~850 MB) are left out: the CUDA device switches cuDNN off (offload/cuda/cuda_device.cpp).
file(GLOB pkg_cudart "${pkg_site}/nvidia/cu*/lib/libcudart.so.[0-9]*")
file(GLOB pkg_nvrtc_builtins "${pkg_site}/nvidia/cu*/lib/libnvrtc-builtins.so.[0-9]*")
foreach(what cudart nvrtc_builtins)
  if(NOT pkg_${what})
    message(FATAL_ERROR "packaging: the wheel in ${pkg_site} has no ${what} library; the packages need it")
  endif()
endforeach()
if(NOT EXISTS "${pkg_site}/torch/lib/libcaffe2_nvrtc.so")
  message(FATAL_ERROR "packaging: ${pkg_site}/torch/lib/libcaffe2_nvrtc.so is missing")
endif()
install(FILES ${pkg_cudart} ${pkg_nvrtc_builtins} "${pkg_site}/torch/lib/libcaffe2_nvrtc.so" DESTINATION ${pkg_lib})
set(pkg_strip libtorch.so libtorch_cpu.so libtorch_cuda.so libtorch_nvshmem.so libc10.so libc10_cuda.so libcaffe2_nvrtc.so libnccl.so.2)
install(CODE "if(CMAKE_INSTALL_DO_STRIP)
  foreach(f ${pkg_strip})
    set(p \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/${pkg_lib}/\${f}\")
    if(EXISTS \"\${p}\")
      execute_process(COMMAND \"${CMAKE_STRIP}\" --strip-unneeded \"\${p}\" RESULT_VARIABLE rc)
      if(NOT rc EQUAL 0)
        message(FATAL_ERROR \"strip \${p} failed\")
      endif()
    endif()
  endforeach()
endif()")
# The wheel's LibTorch libraries (and its libgomp) carry RPATH $ORIGIN/../../nvidia/<x>/lib (the wheel's layout), which
# installed would point at /usr/lib/nvidia/...: searched before $ORIGIN. Everything bundled sits in one
# folder, so they get RPATH $ORIGIN. (NVIDIA's own libraries are left as shipped.)
set(pkg_torch_libs libtorch.so libtorch_cpu.so libtorch_cuda.so libtorch_nvshmem.so libc10.so libc10_cuda.so libcaffe2_nvrtc.so libgomp.so.1)
install(CODE "foreach(f ${pkg_torch_libs})
  set(p \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/${pkg_lib}/\${f}\")
  if(EXISTS \"\${p}\")
    file(READ_ELF \"\${p}\" RPATH rp RUNPATH rup)
    if(rp OR rup)
      file(RPATH_SET FILE \"\${p}\" NEW_RPATH \"\$ORIGIN\")
    endif()
  endif()
endforeach()")
# Licence texts of the bundled wheel components (torch, nvidia-*; cuSPARSELt keeps its licence in its
# package folder instead of its dist-info).
file(GLOB pkg_license_dirs "${pkg_site}/torch-*.dist-info/licenses" "${pkg_site}/nvidia_*.dist-info/licenses")
foreach(d IN LISTS pkg_license_dirs)
  get_filename_component(dist "${d}" DIRECTORY)
  get_filename_component(dist "${dist}" NAME)
  string(REGEX REPLACE "-[0-9].*$" "" dist "${dist}")
  install(DIRECTORY "${d}/" DESTINATION share/lorapipe/licenses/${dist})
endforeach()
file(GLOB pkg_pkg_licenses "${pkg_site}/nvidia/*/LICENSE*")
foreach(f IN LISTS pkg_pkg_licenses)
  get_filename_component(d "${f}" DIRECTORY)
  get_filename_component(d "${d}" NAME)
  install(FILES "${f}" DESTINATION share/lorapipe/licenses/nvidia_${d})
endforeach()
install(FILES "${PROJECT_SOURCE_DIR}/packaging/COPYING" DESTINATION share/lorapipe/licenses/lorapipe)

# bin/ symlinks (relative, so the prefix can move).
foreach(exe lorapipe lorapipe-cli)
  install(CODE "file(MAKE_DIRECTORY \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/bin\")
                file(CREATE_LINK \"../${pkg_bin}/${exe}\" \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/bin/${exe}\" SYMBOLIC)")
endforeach()

# Desktop integration.
set(pkg_app_id io.github.lorapipe.lorapipe)
install(FILES "${PROJECT_SOURCE_DIR}/resources/${pkg_app_id}.desktop" DESTINATION share/applications)
install(FILES "${PROJECT_SOURCE_DIR}/resources/${pkg_app_id}.metainfo.xml" DESTINATION share/metainfo)
install(FILES "${PROJECT_SOURCE_DIR}/resources/lorapipe-mime.xml" DESTINATION share/mime/packages RENAME lorapipe.xml)
install(FILES "${PROJECT_SOURCE_DIR}/resources/icons/lorapipe.svg" DESTINATION share/icons/hicolor/scalable/apps)
install(DIRECTORY "${PROJECT_SOURCE_DIR}/resources/icons/hicolor/" DESTINATION share/icons/hicolor)
# Installed as *.lorapipe.json, the project file type a file manager opens with lorapipe.
file(GLOB pkg_examples "${PROJECT_SOURCE_DIR}/resources/examples/*.json")
foreach(f IN LISTS pkg_examples)
  get_filename_component(stem "${f}" NAME_WLE)
  install(FILES "${f}" DESTINATION share/lorapipe/examples RENAME "${stem}.lorapipe.json")
endforeach()

# Man pages from each program's --help (help2man), compressed as Debian wants them.
find_program(LORAPIPE_HELP2MAN help2man)
if(LORAPIPE_HELP2MAN)
  set(man_dir "${CMAKE_BINARY_DIR}/man")
  add_custom_command(OUTPUT "${man_dir}/lorapipe-cli.1.gz"
    COMMAND ${CMAKE_COMMAND} -E make_directory "${man_dir}"
    COMMAND bash "${PROJECT_SOURCE_DIR}/packaging/man_subcommands.sh" $<TARGET_FILE:lorapipe-cli> "${man_dir}/lorapipe-cli.h2m"
    COMMAND ${LORAPIPE_HELP2MAN} --no-info --section=1 --name "LoRA fine-tuning of LLMs across GPUs (headless)"
            --version-string "lorapipe-cli (lorapipe) ${PROJECT_VERSION}"
            --include "${man_dir}/lorapipe-cli.h2m" --output "${man_dir}/lorapipe-cli.1" $<TARGET_FILE:lorapipe-cli>
    COMMAND gzip -9nf "${man_dir}/lorapipe-cli.1"
    DEPENDS lorapipe-cli "${PROJECT_SOURCE_DIR}/packaging/man_subcommands.sh" VERBATIM)
  add_custom_command(OUTPUT "${man_dir}/lorapipe.1.gz"
    COMMAND ${CMAKE_COMMAND} -E make_directory "${man_dir}"
    COMMAND ${CMAKE_COMMAND} -E env QT_QPA_PLATFORM=offscreen
            ${LORAPIPE_HELP2MAN} --no-info --section=1 --name "LoRA fine-tuning of LLMs across GPUs (desktop application)"
            --version-string "lorapipe ${PROJECT_VERSION}"
            --output "${man_dir}/lorapipe.1" $<TARGET_FILE:lorapipe>
    COMMAND gzip -9nf "${man_dir}/lorapipe.1"
    DEPENDS lorapipe VERBATIM)
  add_custom_target(lorapipe_man ALL DEPENDS "${man_dir}/lorapipe-cli.1.gz" "${man_dir}/lorapipe.1.gz")
  install(FILES "${man_dir}/lorapipe-cli.1.gz" "${man_dir}/lorapipe.1.gz" DESTINATION share/man/man1)
else()
  message(STATUS "packaging: help2man not found; the packages will have no man pages")
endif()

# Debian documentation: copyright (every bundled component and its licence) and a changelog.
set(changelog_gz "${CMAKE_BINARY_DIR}/packaging/changelog.gz")
add_custom_command(OUTPUT "${changelog_gz}"
  COMMAND ${CMAKE_COMMAND} -E make_directory "${CMAKE_BINARY_DIR}/packaging"
  COMMAND sh -c "gzip -9n < '${PROJECT_SOURCE_DIR}/packaging/changelog' > '${changelog_gz}'"
  DEPENDS "${PROJECT_SOURCE_DIR}/packaging/changelog" VERBATIM)
add_custom_target(lorapipe_changelog ALL DEPENDS "${changelog_gz}")
install(FILES "${PROJECT_SOURCE_DIR}/packaging/copyright" "${changelog_gz}" DESTINATION share/doc/lorapipe)
install(FILES "${PROJECT_SOURCE_DIR}/packaging/lintian-overrides" DESTINATION share/lintian/overrides RENAME lorapipe)

# CPack: a .deb and a relocatable .tar.gz. packaging/package.sh picks the generators and compression.
set(CPACK_PACKAGE_NAME lorapipe)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR "The lorapipe developers")
set(CPACK_PACKAGE_CONTACT "lorapipe developers <lorapipe-devel@lists.lorapipe.org>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "LoRA fine-tuning of LLMs pipelined across consumer GPUs")
set(CPACK_PACKAGE_HOMEPAGE_URL "https://github.com/lorapipe/lorapipe")
set(CPACK_RESOURCE_FILE_LICENSE "${PROJECT_SOURCE_DIR}/packaging/COPYING")
set(CPACK_PACKAGE_FILE_NAME "lorapipe-${PROJECT_VERSION}-linux-x86_64")
# Stripped when packaging (CPACK_STRIP_FILES sets CMAKE_INSTALL_DO_STRIP): our executables, and the
# BSD-licensed LibTorch and NCCL libraries, whose symbol tables are ~270 MB. NVIDIA's proprietary
# libraries are shipped as the wheel has them (packaging/lintian-overrides).
set(CPACK_STRIP_FILES TRUE)
set(CPACK_THREADS 0)
set(CPACK_ARCHIVE_THREADS 0)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_ARCHITECTURE amd64)
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION "lorapipe fine-tunes language models (Llama, Mistral, Qwen, Phi-3,
Gemma) with LoRA on several consumer PCIe GPUs or on CPUs. It splits a model
into pipeline stages across the devices, keeps the frozen weights in host
memory and streams them to each device ahead of use. A Qt desktop application
(lorapipe) and a headless command line tool (lorapipe-cli) share one engine;
every run is kept in a run database.
.
The package bundles LibTorch and the NVIDIA CUDA libraries it loads in
/usr/lib/lorapipe/lib.")
# Every system library the executables and the bundled libraries link, by Debian package name
# (tests/packaging/check_package.sh checks that each NEEDED library outside the bundle is owned by
# one of these).
set(CPACK_DEBIAN_PACKAGE_DEPENDS
    "libc6 (>= 2.36), libstdc++6 (>= 12), libgcc-s1, zlib1g, libqt6core6 (>= 6.4), libqt6gui6 (>= 6.4), libqt6widgets6 (>= 6.4), libqt6charts6 (>= 6.4), libqt6svg6 (>= 6.4), libsqlite3-0, libsentencepiece0, libpcre2-8-0, libutf8proc2, libssl3")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "shared-mime-info, desktop-file-utils, hicolor-icon-theme")
set(CPACK_PROJECT_CONFIG_FILE "${PROJECT_SOURCE_DIR}/packaging/cpack_generators.cmake")
include(CPack)
