# Helpers shared by every folder's CMakeLists.txt.

# Warnings (errors in project code) and sanitizers for a project target.
function(strata_target_options target)
  get_target_property(_type ${target} TYPE)
  if(_type STREQUAL "INTERFACE_LIBRARY")
    return()
  endif()
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wcast-align
      -Woverloaded-virtual -Wimplicit-fallthrough -Wformat=2>)
  if(STRATA_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>
                                             $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
  endif()
  if(STRATA_SANITIZE)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${STRATA_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all>)
    target_link_options(${target} PRIVATE -fsanitize=${STRATA_SANITIZE})
  endif()
endfunction()

# strata_library(<name> EXPORT <export-name> FOLDER <dir-under-strata/>
#                SOURCES ... HEADERS ... PUBLIC_DEPS ... PRIVATE_DEPS ...)
# Defines strata_<name>, alias Strata::<export-name>, installs it and its headers
# (as <prefix>/include/strata/<FOLDER>/<header>, a header's sub-folder kept).
function(strata_library name)
  cmake_parse_arguments(ARG "" "EXPORT;FOLDER" "SOURCES;HEADERS;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  if(ARG_SOURCES)
    add_library(${name} ${ARG_SOURCES})
    target_include_directories(${name} PUBLIC $<BUILD_INTERFACE:${STRATA_INCLUDE_ROOT}>
                                              $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
    target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
    set_target_properties(${name} PROPERTIES VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
    strata_target_options(${name})
  else()
    # A layer whose code has not landed yet: its place and its allowed links exist so
    # the dependency graph is fixed; the folder's README.md names the issue that builds it.
    add_library(${name} INTERFACE)
    target_include_directories(${name} INTERFACE $<BUILD_INTERFACE:${STRATA_INCLUDE_ROOT}>
                                                 $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
    target_link_libraries(${name} INTERFACE ${ARG_PUBLIC_DEPS})
  endif()
  set_target_properties(${name} PROPERTIES EXPORT_NAME ${ARG_EXPORT})
  add_library(Strata::${ARG_EXPORT} ALIAS ${name})
  install(TARGETS ${name} EXPORT StrataTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  # A header in a sub-folder (engine/device/device.h) keeps it:
  # <prefix>/include/strata/engine/device/device.h.
  foreach(_header IN LISTS ARG_HEADERS)
    get_filename_component(_dir "${_header}" DIRECTORY)
    install(FILES ${_header} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata/${ARG_FOLDER}/${_dir})
  endforeach()
endfunction()

# strata_executable(<name> SOURCES ... DEPS ... [INSTALL])
function(strata_executable name)
  cmake_parse_arguments(ARG "INSTALL" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  strata_target_options(${name})
  if(ARG_INSTALL)
    install(TARGETS ${name} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  endif()
endfunction()

# strata_gtest(<name> SOURCES ... DEPS ... [LABELS ...])
# One ctest entry per GoogleTest case; GTEST_SKIP() shows as "Skipped" in ctest.
function(strata_gtest name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main)
  strata_target_options(${name})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  # gtest_discover_tests already reports "[  SKIPPED ]" cases as skipped. LABELS is added
  # only when given: an empty value would swallow the next property name. Test names are
  # prefixed with the executable's name so `ctest -R strata_core` selects a suite.
  set(props ENVIRONMENT "STRATA_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
  if(ARG_LABELS)
    list(APPEND props LABELS "${ARG_LABELS}")
  endif()
  gtest_discover_tests(${name}
    TEST_PREFIX "${name}."
    DISCOVERY_MODE PRE_TEST
    PROPERTIES ${props})
endfunction()
