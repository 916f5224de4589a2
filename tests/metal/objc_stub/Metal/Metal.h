// Minimal stand-in declarations (NOT Apple's headers) so tests/metal/run.sh can parse src/metal/backend.mm
// as Objective-C++ on Linux: catches C++/ObjC syntax and host_plan.h drift, not Metal API spelling.
#pragma once
#import <Foundation/Foundation.h>
typedef struct { NSUInteger width, height, depth; } MTLSize;
static inline MTLSize MTLSizeMake(NSUInteger w, NSUInteger h, NSUInteger d) { MTLSize s = {w, h, d}; return s; }
typedef enum { MTLResourceStorageModeShared = 0, MTLResourceStorageModePrivate = 32 } MTLResourceOptions;
typedef enum { MTLMathModeSafe = 0, MTLMathModeRelaxed = 1, MTLMathModeFast = 2 } MTLMathMode;
typedef enum { MTLMathFloatingPointFunctionsFast = 0, MTLMathFloatingPointFunctionsPrecise = 1 } MTLMathFloatingPointFunctions;
typedef enum { MTLCommandBufferStatusCompleted = 4, MTLCommandBufferStatusError = 5 } MTLCommandBufferStatus;
@protocol MTLBuffer <NSObject>
@property(readonly) void* contents;
@end
@protocol MTLFunction <NSObject> @end
@protocol MTLLibrary <NSObject>
- (id<MTLFunction>)newFunctionWithName:(NSString*)name;
@end
@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger threadExecutionWidth;
@end
@protocol MTLComputeCommandEncoder <NSObject>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)s;
- (void)setBuffer:(id<MTLBuffer>)b offset:(NSUInteger)o atIndex:(NSUInteger)i;
- (void)dispatchThreadgroups:(MTLSize)g threadsPerThreadgroup:(MTLSize)t;
- (void)dispatchThreads:(MTLSize)g threadsPerThreadgroup:(MTLSize)t;
- (void)endEncoding;
@end
@protocol MTLCommandBuffer <NSObject>
- (id<MTLComputeCommandEncoder>)computeCommandEncoder;
- (void)commit;
- (void)waitUntilCompleted;
@property(readonly) MTLCommandBufferStatus status;
@property(readonly) NSError* error;
@end
@protocol MTLCommandQueue <NSObject>
- (id<MTLCommandBuffer>)commandBuffer;
@end
@interface MTLCompileOptions : NSObject
@property BOOL fastMathEnabled;
@property MTLMathMode mathMode;
@property MTLMathFloatingPointFunctions mathFloatingPointFunctions;
@end
@protocol MTLDevice <NSObject>
@property(readonly) NSString* name;
- (id<MTLCommandQueue>)newCommandQueue;
- (id<MTLBuffer>)newBufferWithLength:(NSUInteger)n options:(MTLResourceOptions)o;
- (id<MTLBuffer>)newBufferWithBytes:(const void*)p length:(NSUInteger)n options:(MTLResourceOptions)o;
- (id<MTLLibrary>)newLibraryWithURL:(NSURL*)u error:(NSError**)e;
- (id<MTLLibrary>)newLibraryWithSource:(NSString*)s options:(MTLCompileOptions*)o error:(NSError**)e;
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)f error:(NSError**)e;
@end
id<MTLDevice> MTLCreateSystemDefaultDevice(void);
