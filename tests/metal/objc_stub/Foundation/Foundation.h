// Minimal stand-in declarations (NOT Apple's headers) so tests/metal/run.sh can parse src/metal/backend.mm
// as Objective-C++ on Linux: catches C++/ObjC syntax and host_plan.h drift, not Metal API spelling.
#pragma once
typedef signed char BOOL;
#define nil nullptr
#define YES ((BOOL)1)
#define NO ((BOOL)0)
typedef unsigned long NSUInteger;
@protocol NSObject @end
__attribute__((objc_root_class)) @interface NSObject <NSObject>
+ (instancetype)new;
+ (instancetype)alloc;
- (instancetype)init;
@end
@interface NSString : NSObject
@property(readonly) const char* UTF8String;
+ (instancetype)stringWithUTF8String:(const char*)s;
@end
@interface NSError : NSObject
@property(readonly) NSString* localizedDescription;
@end
@interface NSURL : NSObject
+ (NSURL*)fileURLWithPath:(NSString*)p;
@end
